"""The training crop size of each epoch: one size, or FFCV's progressive schedule (low resolution
for most of the run, rising to the final size near its end).

The size is a function of the epoch alone, so a resumed run, mid-epoch or not, crops at the size
an uninterrupted one would, and every worker and process agrees on it without being told.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSizes:
    """min_res up to epoch start_ramp, max_res from epoch end_ramp on, and between them the
    straight line from one to the other, rounded to a multiple of step (FFCV's
    get_resolution). One size: min_res == max_res (TrainSizes.fixed)."""
    min_res: int
    max_res: int
    start_ramp: int = 0
    end_ramp: int = 0
    step: int = 32

    @classmethod
    def fixed(cls, size):
        return cls(size, size)

    @property
    def progressive(self):
        return self.min_res != self.max_res

    def size(self, epoch):
        if not self.progressive or epoch <= self.start_ramp:
            return self.min_res
        if epoch >= self.end_ramp:
            return self.max_res
        done = (epoch - self.start_ramp) / (self.end_ramp - self.start_ramp)
        # round() halves to even, as numpy's round in FFCV's schedule does
        return int(round((self.min_res + done * (self.max_res - self.min_res)) / self.step)) * self.step

    def spans(self, epochs):
        """[(size, first epoch, last epoch)] over epochs 0..epochs-1, in order."""
        spans = []
        for epoch in range(epochs):
            size = self.size(epoch)
            if spans and spans[-1][0] == size:
                spans[-1] = (size, spans[-1][1], epoch)
            else:
                spans.append((size, epoch, epoch))
        return spans

    def distinct(self, epochs):
        """The sizes epochs 0..epochs-1 train at, smallest first."""
        return sorted({size for size, _, _ in self.spans(epochs)})

    def describe(self, epochs):
        """'160 px (epochs 0-12), 192 px (13-15)', or '176 px' for one size."""
        spans = self.spans(epochs)
        if len(spans) <= 1:
            return f"{self.min_res if not spans else spans[0][0]} px"
        parts = [f"{size} px ({first}-{last})" if first != last else f"{size} px ({first})"
                 for size, first, last in spans]
        return parts[0].replace("(", "(epochs ", 1) + ", " + ", ".join(parts[1:])


def train_sizes_of(size):
    """A TrainSizes from a TrainSizes or a single size in pixels."""
    return size if isinstance(size, TrainSizes) else TrainSizes.fixed(int(size))
