# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Removing what was judged orphaned, and nothing else.

Right before each unlink the item is stat'ed again through its directory fd and must still be the very file that was
judged (device, inode, type, ctime); a directory is walked twice, first to check that every entry in it is one that
was judged, then to delete it bottom-up. A file with more than one hard link is left alone.
"""

from __future__ import annotations

import os
import stat as st_mod

from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import walk
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue.walk import Item


# ---------------------------------------------------------------------- removal
class Changed(Exception):
    """The item is no longer what was judged."""


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, st_mod.S_IFMT(a.st_mode), a.st_ctime_ns) == (b.st_dev, b.st_ino, st_mod.S_IFMT(b.st_mode), b.st_ctime_ns)


def _rmtree(parent: int, name: str, item: Item, delete: bool) -> None:
    """Walk a judged directory (never following a symlink): every entry must be one judged orphaned.

    Called twice: first to check the whole tree (``delete=False``), so that a
    file that appeared since the judgement stops the removal before anything
    is gone, then to delete it bottom-up.
    """
    fd = os.open(name, walk.DIR_FLAGS, dir_fd=parent)
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) not in item.tree_dirs:
            raise Changed(f"{name} was replaced")
        with os.scandir(fd) as it:
            entries = [e.name for e in it]
        for child in entries:
            # An entry gone since the listing is no change that matters: the socket glob of the same run
            # may have removed it (torch-shm-dir-*/manager.sock and its directory are both defaults).
            try:
                cst = os.stat(child, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (cst.st_dev, cst.st_ino) not in item.tree:
                raise Changed(f"{child} appeared since it was judged")
            if st_mod.S_ISDIR(cst.st_mode):
                _rmtree(fd, child, item, delete)
            elif delete:
                try:
                    os.unlink(child, dir_fd=fd)
                except FileNotFoundError:
                    pass
    finally:
        os.close(fd)
    if delete:
        os.rmdir(name, dir_fd=parent)


def decide(item: Item) -> tuple[str, str] | None:
    """Whether an item judged orphaned may go now: None, or the ``(verdict, why)`` that keeps it.

    The one decision, for the real run and check mode alike, so that check mode
    reports exactly what a run would do. It reads the item again through its
    directory fd: gone (``vanished``), unreadable (``error``), no longer the very
    file that was judged (another file under the name, or written to:
    ``skipped``), a file with more than one name (``skipped``: another name for
    it may be the one a process opened, and only maps and locks are matched by
    inode), a directory in which anything changed since it was judged
    (``skipped``, nothing inside removed).
    """
    try:
        now = os.stat(item.name, dir_fd=item.dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "vanished", "gone before it was removed"
    except OSError as exc:
        return "error", exc.strerror or str(exc)
    if item.st is None:
        # Found by its directory entry: it must still be that inode, and a regular file.
        same = (now.st_dev, now.st_ino) == item.key and st_mod.S_ISREG(now.st_mode)
        if same:
            item.st, item.nbytes = now, now.st_blocks * 512
    elif item.kind == "dirs":
        # A directory's ctime changes with every entry removed or added (a socket of this run's included);
        # _rmtree checks its entries one by one instead.
        same = (now.st_dev, now.st_ino, st_mod.S_IFMT(now.st_mode)) == (item.st.st_dev, item.st.st_ino, st_mod.S_IFDIR)
    else:
        same = _same(now, item.st)
    if not same:
        return "skipped", "changed since it was judged (another file under this name, or written to); left alone"
    if item.kind != "dirs" and now.st_nlink > 1:
        return "skipped", f"has {now.st_nlink} hard links; left alone"
    if item.kind == "dirs":
        try:
            _rmtree(item.dir_fd, item.name, item, delete=False)
        except Changed as exc:
            return "skipped", f"changed since it was judged ({exc}); left alone"
        except FileNotFoundError:
            return "vanished", "gone before it was removed"
        except OSError as exc:
            return "error", exc.strerror or str(exc)
    return None


def remove(item: Item) -> None:
    """Remove one orphaned item if :func:`decide` lets it go; set its verdict to removed, vanished, skipped or error."""
    kept = decide(item)
    if kept is not None:
        item.verdict, item.why = kept
        return
    try:
        if item.kind == "dirs":
            _rmtree(item.dir_fd, item.name, item, delete=True)
        else:
            os.unlink(item.name, dir_fd=item.dir_fd)
        item.verdict = "removed"
    except Changed as exc:
        item.verdict, item.why = "error", f"partly removed: {exc}"
    except FileNotFoundError:
        item.verdict, item.why = "vanished", "gone before it was removed"
    except OSError as exc:
        item.verdict, item.why = "error", exc.strerror or str(exc)


def remove_all(items: list[Item], check_mode: bool = False) -> None:
    """Remove orphaned items, one after the other; in check mode, only decide each (:func:`decide`), so that the
    items that would stay are reported as staying, with why.

    Directories go last, after the files: a file a glob matched inside a directory another glob matched is
    then reported as removed by its own glob, and the directory's removal finds it gone. One thread: unlinks
    in one directory take that directory's lock in turn, and more threads only added their own cost (9 000
    files in /dev/shm on a 16-CPU H200 node: 66 ms with one thread, 91 ms with two, 130 ms with four).
    """
    for item in sorted(items, key=lambda i: i.kind == "dirs"):
        if not check_mode:
            remove(item)
            continue
        kept = decide(item)
        if kept is not None:
            item.verdict, item.why = kept
