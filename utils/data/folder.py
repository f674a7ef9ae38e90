"""ImageFolder sources: the train/ and val/ checks, a class-folder scan that skips what is not an
image (and says so), and an ImageFolder whose unreadable files are one clear error."""
import os
import stat

from torchvision import datasets as tv_datasets
from torchvision.datasets.folder import IMG_EXTENSIONS

from utils.data.crops import CpuTrainCrop
from utils.data.image_files import UNREADABLE_IMAGE, rgb_loader, rgb_pixels
from utils.run.errors import UnreadableInput, UsageError


def check_image_folder(path, splits=("train", "val")):
    """Clear messages for the usual ImageFolder layout mistakes. Evaluation needs val/ only."""
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise UsageError(f"data directory {path!r} {what}; give an ImageFolder root holding "
                         "train/ and val/, or leave DATA out for the digits demo")
    for split in splits:
        split_dir = os.path.join(path, split)
        if not os.path.isdir(split_dir):
            parent = os.path.dirname(os.path.abspath(path))
            # DATA/train given for DATA: the commonest slip, so name the folder meant
            above = (f" (give {parent!r}, the folder above it)" if os.path.basename(os.path.normpath(path))
                     in ("train", "val") and all(os.path.isdir(os.path.join(parent, s)) for s in splits) else "")
            raise UsageError(f"{path!r} has no {split}/ folder{above}; the layout is DATA/train/<class>/*.jpg "
                             "and DATA/val/<class>/*.jpg")


SHOWN_SKIPS = 10  # paths a skip warning names; the count covers the rest


def scan_class_folders(directory, class_to_idx, extensions=IMG_EXTENSIONS):
    """ImageFolder's (path, class index) samples, in torchvision's order, from folders as found on
    real disks; returns (samples, skipped) with skipped a list of (path, reason).

    torchvision's make_dataset walks with os.walk(followlinks=True): a link back up the tree makes
    it walk in circles (each image counted once per lap until paths grow too long), a file reached
    twice through links counts twice, and a FIFO named x.jpg is kept and blocks the worker that
    opens it forever. Here links to folders are still followed, but every real folder is walked
    once and every real file (device, inode) counted once; only regular files are kept (stat does
    not open a FIFO); and everything left out is named rather than silently dropped.
    """
    skipped = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if not entry.is_dir():  # ImageFolder takes class folders only
            skipped.append((entry.path, "not a class folder"))
    def identity(path):
        info = os.stat(path)
        return info.st_dev, info.st_ino

    # The split folder and every class folder belong to themselves: a link from one class into
    # the split or another class (a loop up the tree, or another class's images) is not followed.
    reserved = {identity(directory)} | {identity(os.path.join(directory, name)) for name in class_to_idx}
    walked_dirs, first_path = {}, {}
    samples = []
    for target_class in sorted(class_to_idx):
        files_by_root = {}
        class_root = os.path.join(directory, target_class)
        stack = [class_root]
        while stack:
            folder = stack.pop()
            try:
                key = identity(folder)
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError as err:
                skipped.append((folder, f"cannot list it: {err.strerror}"))
                continue
            if key in walked_dirs or (key in reserved and folder != class_root):
                skipped.append((folder, f"the same folder as {walked_dirs[key]}" if key in walked_dirs
                                else "a link to the split folder or another class folder"))
                continue
            walked_dirs[key] = folder
            names = files_by_root.setdefault(folder, [])
            for entry in reversed(entries):  # the stack pops them in name order
                try:
                    is_dir = entry.is_dir()  # follows links, as torchvision does
                except OSError:
                    is_dir = False
                if is_dir:
                    stack.append(entry.path)
                else:
                    names.append(entry.name)
        # torchvision's order: folders sorted by path, files by name within each
        for root in sorted(files_by_root):
            for name in sorted(files_by_root[root]):
                path = os.path.join(root, name)
                if not name.lower().endswith(tuple(extensions)):
                    skipped.append((path, "not an image file name"))
                    continue
                try:
                    info = os.stat(path)
                except OSError as err:
                    skipped.append((path, f"a broken link ({err.strerror})"
                                    if os.path.islink(path) else err.strerror))
                    continue
                if not stat.S_ISREG(info.st_mode):
                    skipped.append((path, "not a regular file (a FIFO, socket or device)"))
                    continue
                key = (info.st_dev, info.st_ino)
                if key in first_path:
                    skipped.append((path, f"the same file as {first_path[key]}"))
                    continue
                first_path[key] = path
                samples.append((path, class_to_idx[target_class]))
    found = {index for _, index in samples}
    empty = [name for name in sorted(class_to_idx) if class_to_idx[name] not in found]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        # A class folder that is a link to another one holds that class's images: name the link.
        why = dict(skipped)
        links = [f"{name} is {why[os.path.join(directory, name)]}" for name in empty[:5]
                 if os.path.join(directory, name) in why]
        raise FileNotFoundError(f"no images in the class folder(s) {shown}"
                                + (f" ({'; '.join(links)})" if links else
                                   f"; images end in {', '.join(extensions)}"))
    return samples, skipped


def skipped_message(where, skipped, limit=SHOWN_SKIPS):
    """One warning naming what a scan left out: up to limit paths with their reason, and the count."""
    shown = "; ".join(f"{path} ({reason})" for path, reason in skipped[:limit])
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"{where}: skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'}: {shown}{more}"


class SafeImageFolder(tv_datasets.ImageFolder):
    """ImageFolder whose unreadable images fail with the file's name and the fix, and whose
    folder walk survives link loops, duplicate links and FIFOs (scan_class_folders)."""

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        # An instance method in place of torchvision's staticmethod: DatasetFolder.__init__ calls
        # it through self, and the skipped entries are kept for the warning (sources.folder_dataset_pair).
        samples, self.skipped = scan_class_folders(directory, class_to_idx, extensions or IMG_EXTENSIONS)
        return samples

    def __getitem__(self, index):
        path = self.samples[index][0]
        try:
            return super().__getitem__(index)
        except UNREADABLE_IMAGE as err:
            raise UnreadableInput(f"cannot read image {path!r} ({err}); remove or replace that file") from None


def image_folder(path, split, transform):
    """SafeImageFolder of path/split. The cpu backend's train crop (CpuTrainCrop) takes tensors
    (rgb_pixels); torchvision's validation transforms take PIL images (rgb_loader)."""
    split_dir = os.path.join(path, split)
    loader = rgb_pixels if isinstance(transform, CpuTrainCrop) else rgb_loader
    try:
        return SafeImageFolder(split_dir, transform=transform, loader=loader)
    except (FileNotFoundError, RuntimeError) as err:
        raise UsageError(f"{split_dir!r} holds no images in class folders ({err}); the layout is "
                         f"DATA/{split}/<class>/*.jpg") from None
