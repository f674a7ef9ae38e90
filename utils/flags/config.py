"""--config FILE.yaml: a recipe's flag values, each read through its flag's own argparse type and
choices as if typed, for utils.flags.precedence to lay between the checkpoint's and the typed."""
import argparse

from utils.flags.parser import flag_actions, flag_name, str2bool
from utils.run.errors import UsageError

# Flags a recipe file may not set: --config itself, the per-process launcher flag and --help.
NOT_IN_CONFIG = ("config", "local_rank", "help")
# Keys a recipe file refuses by name: where a run lives and what it continues are the command
# line's (--resume auto looks in --output-dir before any recipe is read).
RUN_NOT_RECIPE = ("output_dir", "resume")


def load_config(parser, path):
    """The flag values of a --config YAML file as {dest: value}, each through its flag's type.
    Unknown keys, a key given twice (lr and --lr) and wrong types are UsageErrors naming key and file."""
    import yaml  # only runs with --config read YAML

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise UsageError(f"--config {path!r}: cannot read it ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"--config {path!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise UsageError(f"--config {path!r} is not valid YAML ({' '.join(str(err).split())[:160]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must be a mapping of flag names to values, found a "
                         f"{type(data).__name__}")
    keys, values, source = {}, {}, {}  # keys: the dest (batch_size) and each option without dashes (batch-size, b)
    for dest, action in flag_actions(parser).items():
        if dest not in NOT_IN_CONFIG and dest != argparse.SUPPRESS:
            keys.update({dest: action}, **{option.lstrip("-"): action for option in action.option_strings})
    for key, value in data.items():
        action = keys.get(str(key))
        if action is not None and action.dest in RUN_NOT_RECIPE:
            raise UsageError(f"--config {path!r}: {key!r} names a run, not a recipe; give {flag_name(action)} on "
                             "the command line")
        if action is None:
            raise UsageError(f"--config {path!r}: unknown key {key!r} (not a flag of {parser.prog}; keys are "
                             "flag names without dashes, e.g. lr or batch-size)")
        if action.dest in values:
            raise UsageError(f"--config {path!r}: {key!r} sets {flag_name(action)} that {source[action.dest]!r} "
                             "already set; keep one")
        values[action.dest] = _convert(action, value, f"--config {path!r}, key {key!r}")
        source[action.dest] = key
    return values


def _convert(action, value, where):
    """A YAML value through the flag's own argparse type and choices, as on the command line."""
    flag = flag_name(action)
    # a switch takes a YAML boolean: true/false (a True|False switch also null, for its default);
    # nargs 0 is store_true/store_false (-e, --overwrite), whose const is the value the flag stores
    if (action.nargs == 0 or action.type is str2bool and value is not None) and not isinstance(value, bool):
        raise UsageError(f"{where}: {flag} is a switch; give true or false, got {value!r}")
    if action.nargs == 0:
        return value if action.const else not value
    if value is None:
        return None
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:  # argparse refuses the bare flag; [] would mean "no milestones"
            raise UsageError(f"{where}: {flag} takes one or more values, got []")
        return [_convert_one(action, item, where) for item in items]
    if isinstance(value, (list, dict)):
        raise UsageError(f"{where}: {flag} takes one value, got {value!r}")
    return _convert_one(action, value, where)


def _convert_one(action, value, where):
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
        raise UsageError(f"{where}: bad value for {flag_name(action)}: {err}") from None
    if action.choices is not None and converted not in action.choices:
        raise UsageError(f"{where}: {flag_name(action)} must be one of "
                         f"{', '.join(map(str, action.choices))}, got {value!r}")
    return converted
