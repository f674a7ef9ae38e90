"""eval.py --predictions: every val image's top-5 classes and probabilities, recorded as the loss is
computed, gathered from all processes and written as one CSV (a header and one row per image, in
val-split order: index, path, label and its name, then 5 class indices, probabilities and names)."""
import csv
import io
import os

import torch

from utils.run.files import atomic_write


class PredictionRecorder(torch.nn.Module):
    """The eval criterion that also keeps each batch's top-k classes and probabilities.

    validate() hands the criterion every batch's logits and targets, in loader order, so recording
    here needs no second pass over the val split and no change to the shared loop. Kept on the
    device until the end: no host sync per batch.
    """

    def __init__(self, criterion, num_classes, k=5):
        super().__init__()
        self.criterion = criterion
        self.k = min(k, num_classes)
        self.top, self.classes, self.targets = [], [], []

    def forward(self, output, target):
        with torch.no_grad():
            top = torch.softmax(output.float(), dim=1).topk(self.k, dim=1)
            self.top.append(top.values)
            self.classes.append(top.indices)
            self.targets.append(target)
        return self.criterion(output, target)

    def rows(self, indices, paths, names):
        """This process's rows; indices: the val-split index of each image it scored, in order."""
        if not self.targets:
            return []
        probs, classes = torch.cat(self.top).cpu().tolist(), torch.cat(self.classes).cpu().tolist()
        targets = torch.cat(self.targets).cpu().tolist()
        if len(targets) != len(indices):  # a sharding change must not mislabel rows
            raise RuntimeError(f"scored {len(targets)} images but this process's share is {len(indices)}")
        name = lambda label: names[label] if names and label < len(names) else ""
        return [[index, paths[index] if paths else "", label, name(label), *top_classes,
                 *[round(p, 6) for p in top_probs], *[name(c) for c in top_classes]]
                for index, label, top_classes, top_probs in zip(indices, targets, classes, probs)]


def val_identity(data, accelerator):
    """(val-split indices this process scores, in order; file paths by index or None).

    utils.data.batches.sharded_data gives rank r every world-th image: r, r + world, ...; ImageFolder
    sources (and the digits cache) know each image's path, datasets sources only its row."""
    indices = list(range(accelerator.process_index, data.val_size, accelerator.num_processes))
    dataset = getattr(getattr(data.val, "loader", None), "dataset", None)
    samples = getattr(dataset, "samples", None)
    # Only file paths name an image (a datasets source read by the gpu backend holds row keys).
    if not samples or not isinstance(samples[0][0], (str, os.PathLike)):
        return indices, None
    return indices, [str(where) for where, _ in samples]


def write_predictions(recorder, data, accelerator, path, names=None):
    """Gather every process's rows to the main process, check each image is there once, write.
    names: the class names in label order where data knows none (a checkpoint's)."""
    from accelerate.utils import gather_object

    indices, paths = val_identity(data, accelerator)
    names = data.classes or names
    rows = gather_object(recorder.rows(indices, paths, names))
    if not accelerator.is_main_process:
        return
    rows.sort(key=lambda row: row[0])
    if [row[0] for row in rows] != list(range(data.val_size)):
        raise RuntimeError(f"predictions hold {len(rows)} rows for a val split of {data.val_size} images")
    ranks = range(1, recorder.k + 1)
    header = ["index", "path", "label", "label_name", *[f"pred{r}" for r in ranks],
              *[f"prob{r}" for r in ranks], *[f"name{r}" for r in ranks]]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write(path, buffer.getvalue())
