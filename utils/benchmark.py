"""profile.py --benchmark's rows: one configuration's timings and peak memory, the table printed
as rows come, and the CSV rewritten after each (atomically)."""
import csv
import io
from dataclasses import dataclass, field

from utils.profiling import PhaseTimes
from utils.run.files import atomic_write


@dataclass
class BenchmarkRow:
    opt_level: str
    dtype: str
    channels_last: bool
    images_per_step: int
    times: PhaseTimes = None          # None when the configuration failed
    peak_bytes: int = None
    note: str = ""
    extra: dict = field(default_factory=dict)  # arch, image size, device: context for the CSV

    @property
    def img_per_s(self):
        return self.images_per_step * 1e3 / self.times.step_ms if self.times else None


def _ratio(row, first):
    if not (row.times and first.times):
        return None
    return row.img_per_s / first.img_per_s


def format_benchmark_table(rows):
    lines = [f"{'opt level':<10}{'dtype':<6}{'channels_last':<15}{'img/s':>10}{'ms/step':>10}"
             f"{'peak GiB':>10}{'ratio':>8}  note"]
    for row in rows:
        if row.times is None:
            numbers = f"{'-':>10}{'-':>10}{'-':>10}{'-':>8}"
        else:
            peak = "n/a" if row.peak_bytes is None else f"{row.peak_bytes / 2 ** 30:.2f}"
            numbers = (f"{row.img_per_s:>10.1f}{row.times.step_ms:>10.2f}{peak:>10}"
                       f"{_ratio(row, rows[0]) or 0:>7.2f}x")
        lines.append(f"{row.opt_level:<10}{row.dtype:<6}{str(row.channels_last):<15}{numbers}  {row.note}")
    return "\n".join(lines)


def write_benchmark_csv(rows, path):
    """One row per configuration; the phase columns are mean ms per step over the window."""
    phase_labels = []
    for row in rows:
        for label, _ in (row.times.phases if row.times else []):
            if label not in phase_labels:
                phase_labels.append(label)
    context = list(rows[0].extra) if rows else []
    header = (context + ["opt_level", "dtype", "channels_last", "global_batch", "img_per_s",
                         "ms_per_step", "peak_gib", "ratio"]
              + [label.replace(" ", "_").replace("-", "_") + "_ms" for label in phase_labels] + ["note"])
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(header)
    for row in rows:
        phases = dict(row.times.phases) if row.times else {}
        ratio = _ratio(row, rows[0])
        writer.writerow(
            [row.extra.get(key, "") for key in context]
            + [row.opt_level, row.dtype, row.channels_last, row.images_per_step,
               _num(row.img_per_s, 1), _num(row.times.step_ms if row.times else None, 3),
               _num(None if row.peak_bytes is None else row.peak_bytes / 2 ** 30, 3), _num(ratio, 3)]
            + [_num(phases.get(label), 3) for label in phase_labels] + [row.note])
    atomic_write(path, text.getvalue())  # a reader (or a killed sweep) never sees half a file


def _num(value, digits):
    return "" if value is None else f"{value:.{digits}f}"
