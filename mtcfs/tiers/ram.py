"""The RAM tier: one tmpfs file per mtcfs file, under a byte budget.

File data never passes through the Python heap beyond the one request being
served: writes are pwrite()s into `<ram-dir>/data/<ino>`, reads are pread()s.
Because the data is in tmpfs and not in the process, a restarted daemon finds
it again.

Space accounting is exact for what is written past the end of a file (the
common, sequential case). Bytes written into holes are counted when the file
is sealed or truncated, from the blocks tmpfs really allocated.

With FUSE passthrough the trainer's writes go to these files without passing
the daemon, so the daemon cannot count them: the data directory is then a
tmpfs of its own, mounted with size=--ram-size, and the kernel enforces the
budget (`own_tmpfs`). What is used is then what that tmpfs says, or what the
daemon has reserved (replicas and fetches about to arrive), whichever is more.
That tmpfs backs files with transparent huge pages where they fit within the
file (huge=within_size; --huge-pages may turn them off, see mtcfs.tiers.huge_pages):
a 2 MiB page per fault instead of 512 small ones makes writing into it, and
reading from it, about twice as cheap (docs/benchmarks.md); small files and the
tail of a file keep small pages, so none is rounded up (a write into a hole of a
file sized beforehand takes its whole 2 MiB page).
Everything the budget covers lives in that one directory (replicas being
received in `.incoming`, data being deleted in `.trash`), so renames between
them never cross filesystems.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import subprocess

import trio

from mtcfs.mountinfo import entry_at
from mtcfs.tiers.huge_pages import HugePages
from mtcfs.tiers.mapped import MappedFiles

log = logging.getLogger(__name__)

# fallocate(2) modes: the ones tmpfs has (besides 0, which allocates and may extend).
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(None, use_errno=True)  # os has posix_fallocate only (mode 0)
_fallocate = _libc.fallocate64
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


class RamTierFull(OSError):
    def __init__(self, need: int, free: int) -> None:
        super().__init__(errno.ENOSPC, f"RAM tier full: need {need} bytes, {free} free")
        self.need = need


class RamTier:
    def __init__(self, root: str, capacity: int, own_tmpfs: bool = False,
                 huge_pages: HugePages | None = None) -> None:
        self.root = root
        self.data_dir = os.path.join(root, "data")
        self.incoming_dir = os.path.join(self.data_dir, ".incoming")  # replicas being received
        self.trash_dir = os.path.join(self.data_dir, ".trash")
        self.own_tmpfs = own_tmpfs
        self.huge_pages = huge_pages or HugePages("always")
        # Files mapped now (seal passes, transfers): worth it only on huge pages.
        self.mapped = MappedFiles(lambda: self.huge_pages.in_use)
        self.mounted_tmpfs = False  # this daemon mounted it (none was there to re-adopt)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        _drop_old_layout(root)
        if own_tmpfs:
            self.mounted_tmpfs = mount_tmpfs(self.data_dir, capacity, self.huge_pages,
                                             os.path.join(root, ".huge-probe"))
        for d in (self.incoming_dir, self.trash_dir):
            os.makedirs(d, mode=0o700, exist_ok=True)
        self._incoming_seq = 0
        self._trash_seq = 0
        self.trash_added = trio.Event()
        self.capacity = capacity
        self._used = 0  # what the daemon has charged: written through it, or reserved
        self._charged: dict[int, int] = {}
        # Where blocks allocated past the end of a file (fallocate KEEP_SIZE) may end.
        self._allocated_end: dict[int, int] = {}
        self._fds: dict[int, list[int]] = {}  # ino -> [fd, refcount]
        self.enospc_count = 0  # writes refused (counted by the filesystem)
        self.refused_incoming = 0  # replicas from peers refused for lack of space

    @property
    def used(self) -> int:
        if not self.own_tmpfs:
            return self._used
        st = os.statvfs(self.data_dir)
        return max(self._used, (st.f_blocks - st.f_bfree) * st.f_frsize)

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)

    # -- files -----------------------------------------------------------------

    def path(self, ino: int) -> str:
        """The data file's path: only for a library or a process that opens it itself
        (an upload's client, a replication worker process); in this process the
        files are opened here."""
        return os.path.join(self.data_dir, str(ino))

    def exists(self, ino: int) -> bool:
        return os.path.exists(self.path(ino))

    def stat(self, ino: int) -> os.stat_result:
        """The data file's stat (raises FileNotFoundError)."""
        return os.stat(self.path(ino))

    def open_read(self, ino: int) -> int:
        """A private read-only fd of the data file (the caller closes it; raises
        FileNotFoundError): a copy being read (checksummed, uploaded, served)."""
        return os.open(self.path(ino), os.O_RDONLY | os.O_CLOEXEC)

    def open_fill(self, ino: int) -> int:
        """A private read/write fd of the data file (the caller closes it): a download
        filling it, which must not follow the file if it is replaced meanwhile."""
        return os.open(self.path(ino), os.O_RDWR | os.O_CLOEXEC)

    def create(self, ino: int) -> None:
        fd = os.open(self.path(ino), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        self._set_charge(ino, 0)

    def replace(self, ino: int) -> None:
        """Like create(), but always a new file: whoever still writes into the old
        one through an fd of its own (a read-through fetch) cannot touch the new
        data. Open handles' shared fd is moved onto the new file (dup2)."""
        self._to_trash(ino)
        fd = os.open(self.path(ino), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            entry = self._fds.get(ino)
            if entry is not None:
                os.dup2(fd, entry[0], inheritable=False)
        finally:
            os.close(fd)
        self._set_charge(ino, 0)

    def acquire(self, ino: int) -> int:
        """A read/write fd for the file's data, shared by all its open handles."""
        entry = self._fds.get(ino)
        if entry is None:
            fd = os.open(self.path(ino), os.O_RDWR | os.O_CREAT, 0o600)
            entry = self._fds[ino] = [fd, 0]
        entry[1] += 1
        return entry[0]

    def release(self, ino: int) -> None:
        entry = self._fds.get(ino)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            os.close(entry[0])
            del self._fds[ino]

    def fd(self, ino: int) -> int | None:
        entry = self._fds.get(ino)
        return entry[0] if entry else None

    def remove(self, ino: int) -> None:
        """Drop a file's data. Unlinking a multi-GiB tmpfs file takes a second,
        so the file is only renamed into trash/ here and unlinked by
        empty_trash() in a worker thread, never on the thread serving FUSE."""
        entry = self._fds.pop(ino, None)
        if entry is not None:
            os.close(entry[0])
        self._to_trash(ino)
        self._set_charge(ino, 0)
        self._charged.pop(ino, None)
        self._allocated_end.pop(ino, None)

    def _to_trash(self, ino: int) -> None:
        self._trash_seq += 1
        try:
            os.rename(self.path(ino), os.path.join(self.trash_dir, f"{ino}.{self._trash_seq}"))
            self.trash_added.set()
        except FileNotFoundError:
            pass

    async def empty_trash(self) -> None:
        """Runs for the daemon's lifetime: unlinks trashed data off the event loop."""
        while True:
            await self.trash_added.wait()
            self.trash_added = trio.Event()
            await trio.to_thread.run_sync(self._empty_trash_now)

    def _empty_trash_now(self) -> None:
        for name in os.listdir(self.trash_dir):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.trash_dir, name))

    # -- data path -------------------------------------------------------------

    def write(self, ino: int, fd: int, off: int, buf: bytes, cur_size: int) -> int:
        grow = off + len(buf) - max(cur_size, off)
        if grow > 0 and self._allocated_end:  # blocks fallocate charged already
            grow = off + len(buf) - max(cur_size, off, self._allocated_end.get(ino, 0))
        if grow > 0:
            free = self.capacity - self.used
            if grow > free:
                raise RamTierFull(grow, free)
            self._used += grow
            self._charged[ino] = self._charged.get(ino, 0) + grow
        try:
            return os.pwrite(fd, buf, off)
        except OSError:
            self.reconcile(ino)
            raise

    def truncate(self, ino: int, fd: int, size: int, cur_size: int) -> None:
        # Extending makes a hole: tmpfs allocates nothing for it.
        os.ftruncate(fd, size)
        self.reconcile(ino)

    def room_to_allocate(self, fd: int, off: int, end: int) -> int:
        """What allocating [off, end) of the file may take: the ranges tmpfs holds no data
        for (blocks allocated but never written count too: this errs on the side of
        asking for room). Raises RamTierFull unless the budget holds it."""
        need = _holes(fd, off, end)
        free = self.capacity - self.used
        if need > free:
            raise RamTierFull(need, free)
        return need

    async def fallocate(self, ino: int, fd: int, mode: int, off: int, length: int,
                        reserve: int = 0) -> None:
        """fallocate(2) on the file's data (in a worker thread: a large allocation takes a
        while), `reserve` bytes charged meanwhile; then charge the file for what tmpfs
        holds. Raises OSError."""
        if mode & FALLOC_FL_KEEP_SIZE and not mode & FALLOC_FL_PUNCH_HOLE:
            self._allocated_end[ino] = max(self._allocated_end.get(ino, 0), off + length)
        self._set_charge(ino, self.charged(ino) + reserve)
        try:
            await trio.to_thread.run_sync(_fallocate_fd, fd, mode, off, length)
        finally:
            self.reconcile(ino)

    def reconcile(self, ino: int) -> int:
        """Charge the file for the blocks tmpfs really holds."""
        try:
            st = os.stat(self.path(ino))
            end = max(st.st_size, self._allocated_end.get(ino, 0))
            actual = min(st.st_blocks * 512, end + 4096)
        except FileNotFoundError:
            actual = 0
        self._set_charge(ino, actual)
        return actual

    def reserve(self, ino: int, amount: int) -> None:
        """Charge a file for data about to arrive (a fetch), before it is written."""
        self._set_charge(ino, max(self._charged.get(ino, 0), amount))

    def charged(self, ino: int) -> int:
        return self._charged.get(ino, 0)

    def _set_charge(self, ino: int, amount: int) -> None:
        self._used += amount - self._charged.get(ino, 0)
        self._charged[ino] = amount

    # -- replicas received from peers ---------------------------------------------

    def begin_incoming(self, size: int) -> tuple[int, str]:
        """Reserve `size` bytes for a replica about to arrive; returns (key, path).
        Raises RamTierFull when the budget cannot hold it."""
        free = self.capacity - self.used
        if size > free:
            self.refused_incoming += 1
            raise RamTierFull(size, free)
        self._incoming_seq += 1
        key = -self._incoming_seq  # charges of incoming files use negative keys
        self._set_charge(key, size)
        path = os.path.join(self.incoming_dir, str(self._incoming_seq))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # At its full size (a hole: nothing allocated) so that huge pages back it
            # (huge=within_size): growing by appends it got small ones. A push of 1 GiB,
            # alternated: 850 against 739 MiB/s, receiver 0.81 against 0.95 CPU-s.
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return key, path

    def abort_incoming(self, key: int, path: str) -> None:
        self._set_charge(key, 0)
        self._charged.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, os.path.join(self.trash_dir, f"in{-key}"))
            self.trash_added.set()

    def install_incoming(self, key: int, path: str, ino: int) -> None:
        """Make a received, verified replica the data of `ino`. Handles' shared fd
        moves onto it (as in replace())."""
        self._to_trash(ino)
        os.rename(path, self.path(ino))
        entry = self._fds.get(ino)
        if entry is not None:
            fd = os.open(self.path(ino), os.O_RDWR)
            try:
                os.dup2(fd, entry[0], inheritable=False)
            finally:
                os.close(fd)
        self._set_charge(key, 0)
        self._charged.pop(key, None)
        self.reconcile(ino)

    # -- startup ---------------------------------------------------------------

    def adopt(self, keep: set[int]) -> tuple[int, int]:
        """Account for the data files of `keep`; delete the others (orphans).

        Returns (files adopted, orphans removed)."""
        self._empty_trash_now()
        for name in os.listdir(self.incoming_dir):  # a replica cut short by a crash
            os.unlink(os.path.join(self.incoming_dir, name))
        adopted = removed = 0
        for name in os.listdir(self.data_dir):
            if name.startswith("."):
                continue  # .incoming, .trash
            try:
                ino = int(name)
            except ValueError:
                ino = -1
            if ino in keep:
                self.reconcile(ino)
                adopted += 1
            else:
                os.unlink(os.path.join(self.data_dir, name))
                removed += 1
        return adopted, removed

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _fallocate_fd(fd: int, mode: int, off: int, length: int) -> None:
    if _fallocate(fd, mode, off, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _holes(fd: int, off: int, end: int) -> int:
    """Bytes of [off, end) that tmpfs reports as holes (SEEK_DATA/SEEK_HOLE), or past
    the end of the file."""
    size = os.fstat(fd).st_size
    holes, pos = 0, off
    while pos < min(end, size):
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            data = size  # only a hole from pos to the end
        data = min(data, end, size)
        holes += data - pos
        if data >= min(end, size):
            pos = data
            break
        pos = os.lseek(fd, data, os.SEEK_HOLE)
    return holes + max(0, end - max(pos, size))


def _drop_old_layout(root: str) -> None:
    """Before replicas and trash moved into data/, they lived beside it: both only
    ever hold leftovers (emptied at start-up)."""
    for name in ("incoming", "trash"):
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(os.path.join(root, name))


def mount_tmpfs(path: str, size: int, huge_pages: HugePages, scratch: str) -> bool:
    """Make `path` a tmpfs of `size` bytes: mount one, or resize the one a previous
    daemon mounted (a restarted daemon re-adopts what it holds). Data found in the
    directory before it was a mount (an earlier daemon without passthrough) is
    moved into the new tmpfs first. Needs CAP_SYS_ADMIN. Returns True if it mounted
    a new one. `scratch`: where the huge pages' probe may mount its own."""
    e = entry_at(path)
    opts = f"size={size},mode=0700"
    huge = huge_pages.mount_option(scratch)
    if e is not None and e.fstype == "tmpfs":
        _mount_huge(["-o", f"remount,{opts}", path], huge, huge_pages)
        return False
    old = [n for n in os.listdir(path)]
    aside = ""
    if old:
        aside = path + ".premount"
        os.rename(path, aside)
        os.makedirs(path, mode=0o700)
    _mount_huge(["-t", "tmpfs", "-o", opts, "mtcfs-ram", path], huge, huge_pages)
    if aside:
        for name in os.listdir(aside):  # sparse-aware copy: cp keeps the holes
            subprocess.run(["cp", "-a", "--sparse=always", os.path.join(aside, name), path],
                           check=True, capture_output=True)
        shutil.rmtree(aside)
        log.info("moved %d data files into the RAM tier's tmpfs %s", len(old), path)
    return True


def _mount_huge(args: list[str], huge: str, huge_pages: HugePages) -> None:
    """mount(8) with huge=`huge` added to the options (args: ..., "-o", opts, ...);
    with huge=never where the kernel has no huge pages for tmpfs. Always explicit:
    a remount keeps the huge= of the mount it changes otherwise."""
    i = args.index("-o") + 1
    try:
        _mount([*args[:i], args[i] + f",huge={huge}", *args[i + 1:]])
    except OSError as e:
        if huge == "never":
            raise
        log.info("RAM tier tmpfs without huge pages (%s)", e)
        huge = "never"
        _mount([*args[:i], args[i] + ",huge=never", *args[i + 1:]])
    huge_pages.mounted(huge)


def _mount(args: list[str]) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(errno.EPERM, f"mount {' '.join(args)}: {r.stderr.strip()}")


def unmount_tmpfs(path: str) -> None:
    """Unmount the RAM tier's tmpfs (its data goes with it): tests and tear-down."""
    if entry_at(path) is not None:
        subprocess.run(["umount", "-l", path], capture_output=True)
