"""The flags room: the command line of train.py, eval.py and profile.py, parsed and resolved once.

parser.py      the value types (one bounded-number factory, True|False, opt levels, loss scale), the
               parser with one-line errors and DATA after a bare switch, the flag groups each
               script's parser is built from, and the warnings for typed flags a run will not use
config.py      --config FILE.yaml: a recipe's values, each through its flag's own type
precedence.py  parse_args: defaults < a resumed checkpoint's flags < --config < typed (parse_flags),
               the source's and the model's defaults for flags left out, the checks across flags
specs.py       the scripts' edge: resolved flags become each concern's frozen spec
"""
