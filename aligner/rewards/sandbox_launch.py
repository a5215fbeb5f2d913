"""The sandbox's launcher, the one piece that runs between the host and an untrusted program. Started by
`aligner.rewards.sandbox` as `python -I -S -B sandbox_launch.py CONFIG_JSON` in a new session, it imports
the standard library only (isolated mode sees no site-packages) and, in this order:

1. isolated mode: `unshare` of new mount, network, PID, IPC and UTS namespaces (plus a user namespace when
   not root, mapping the user to itself); every inherited mount becomes private and read-only, nosuid
   (`mount_setattr(AT_RECURSIVE)`); a size-limited tmpfs goes over /tmp (also bind-mounted on /dev/shm and
   /var/tmp) and an empty read-only tmpfs over /run; the program's files, read from the host's working
   directory beforehand, are written to /tmp/work on that tmpfs.
2. isolated mode: forks the namespace's init (PID 1: when it exits, the kernel kills every process left in
   the namespace; it dies with the launcher, by a parent-death SIGKILL), which mounts a fresh /proc (only the
   namespace's processes; an empty tmpfs where the kernel refuses), forks the program's process, reaps
   orphans and exits as the program did. Unisolated, the launcher forks the program's process itself.
3. the program's process enters the working directory, sets the resource limits, drops to the sandbox uid
   (when root), sets no_new_privs and a parent-death SIGKILL, restores every signal's default action and
   unblocks them (a reward worker ignores SIGINT and SIGUSR1), and execs the interpreter.
4. the launcher waits and exits with the program's exit code, or 128 + the signal that killed it.

A setup failure exits with SETUP_FAILED after one line on stderr starting with PREFIX. The host side
documents what this does and does not protect against.
"""
import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 120
PREFIX = "aligner-sandbox: "
WORKDIR = "/tmp/work"

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_PRIVATE = 1, 2, 4, 8, 4096, 1 << 18
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
SYS_MOUNT_SETATTR = 442  # the same number on x86_64, arm64 and the other generic-table architectures
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.syscall.restype = ctypes.c_long


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    check(libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                     data.encode() if data else None), f"mount {fstype or 'bind'} on {target}")


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def isolate(cfg: dict) -> None:
    """Step 1 (see the module doc); the working directory ends up at WORKDIR."""
    uid, gid, root = os.geteuid(), os.getegid(), os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (0 if root else CLONE_NEWUSER)
    check(libc.unshare(flags), "unshare (namespaces)")
    if not root:
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", f"{uid} {uid} 1")
        write("/proc/self/gid_map", f"{gid} {gid} 1")
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, MS_PRIVATE, 0)
    check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
                       ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
          "mount_setattr (read-only host filesystem)")
    files = {}
    for name in os.listdir(cfg["host_workdir"]):
        with open(os.path.join(cfg["host_workdir"], name), "rb") as f:
            files[name] = f.read()
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['disk_mb']}m,nr_inodes={cfg['inodes']},mode=1777")
    os.mkdir("/tmp/.shm")
    os.chmod("/tmp/.shm", 0o1777)
    for shared in ("/dev/shm", "/var/tmp"):
        if os.path.isdir(shared):
            mount("/tmp/.shm", shared, None, MS_BIND)
    if os.path.isdir("/run"):
        mount("tmpfs", "/run", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    os.mkdir(WORKDIR, 0o700)
    for name, data in files.items():
        write_bytes(os.path.join(WORKDIR, name), data)
    if cfg["uid"] is not None:
        for path in (WORKDIR, *(os.path.join(WORKDIR, n) for n in files)):
            os.chown(path, cfg["uid"], cfg["gid"])


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def init() -> None:
    """Step 2 as PID 1 of the new PID namespace; returns in the program's process only."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the only signal with a handler, which a program could send
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # e.g. a user namespace inside a container whose /proc is partly masked
        mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        return
    while True:
        child, status = os.waitpid(-1, 0)
        if child == pid:
            os._exit(exit_code(status))


def program(cfg: dict, workdir: str, isolated: bool) -> None:
    """Step 3, in the program's process; never returns."""
    os.chdir(workdir)
    cpu = max(1, int(cfg["cpu_s"] + 0.999))
    limits = {resource.RLIMIT_CPU: (cpu, cpu + 1), resource.RLIMIT_AS: (cfg["memory_bytes"],) * 2,
              resource.RLIMIT_FSIZE: (cfg["file_bytes"],) * 2, resource.RLIMIT_NPROC: (cfg["nproc"],) * 2,
              resource.RLIMIT_CORE: (0, 0), resource.RLIMIT_NOFILE: (cfg["open_files"],) * 2}
    for which, value in limits.items():
        resource.setrlimit(which, value)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")  # after setuid
    if not isolated and os.getppid() != cfg["launcher_pid"]:
        os._exit(SETUP_FAILED)  # the launcher died before the death signal was armed (isolated: init's is)
    for number in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:  # what the host ignored or blocked
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):  # signals the C library reserves
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.closerange(3, 1 << 16)
    os.execve(cfg["python"], [cfg["python"], *cfg["argv"]], cfg["env"])


def fail(message: str) -> None:
    os.write(2, f"{PREFIX}{message}\n".encode(errors="replace"))
    os._exit(SETUP_FAILED)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    isolated = cfg["isolate"]
    try:
        if isolated:
            isolate(cfg)
        elif cfg["uid"] is not None:
            os.chown(cfg["host_workdir"], cfg["uid"], cfg["gid"])
        cfg["launcher_pid"] = os.getpid()
        pid = os.fork()
    except Exception as e:  # noqa: BLE001 - whatever failed, the host must see a setup failure
        fail(f"setup failed: {type(e).__name__}: {e}")
    if pid == 0:
        try:
            if isolated:
                init()
            program(cfg, WORKDIR if isolated else cfg["host_workdir"], isolated)
        except BaseException as e:  # noqa: BLE001 - whatever failed, the host must see a setup failure
            fail(f"setup failed: {type(e).__name__}: {e}")
    os._exit(exit_code(os.waitpid(pid, 0)[1]))


if __name__ == "__main__":
    main()
