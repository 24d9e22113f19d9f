"""The seccomp filter bubblewrap loads before it runs the harness (bwrap --seccomp FD).

A deny list over an allow-by-default filter, compiled to a BPF program by libseccomp (the C library
every distribution ships, reached through ctypes: no Python binding needed). What it refuses
(EPERM), and why: the kernel keyring (keyctl, add_key, request_key: the keys of the host's users),
tracing other processes (ptrace, process_vm_*), new namespaces (unshare, setns, clone with a
CLONE_NEW* flag: a user namespace would give the agent capabilities over a new world to attack the
kernel from), mounts, eBPF and perf events (large kernel attack surface), io_uring (the same), kernel
modules, kexec, reboot, swap, clock and quota changes, the kernel log. clone3 answers ENOSYS so that
libc falls back to clone, whose flags the filter can read. Syscalls of another architecture (the
32-bit ABIs) kill the process: libseccomp's default for a foreign architecture.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import cache

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7

DENIED = (
    "keyctl", "add_key", "request_key",
    "ptrace", "process_vm_readv", "process_vm_writev",
    "unshare", "setns",
    "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "iopl", "ioperm", "lookup_dcookie", "uselib", "vhangup",
)
CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
             "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
             "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}


class SeccompError(RuntimeError):
    """No seccomp filter can be built here; the message says why and how to get one."""


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def _lib():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise SeccompError(f"libseccomp is not installed ({e}): the bubblewrap sandbox's seccomp filter is built "
                           "with it. Install it (apt-get install -y libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


@cache
def seccomp_bpf() -> bytes:
    """The filter as a BPF program (struct sock_filter[]), as bwrap --seccomp reads it."""
    lib = _lib()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompError("seccomp_init failed")
    try:
        def rule(action: int, name: str, *cmps: _ArgCmp) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # not a syscall on this architecture (e.g. iopl on arm64): nothing to deny
                return
            arr = (_ArgCmp * len(cmps))(*cmps) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise SeccompError(f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")

        for name in DENIED:
            rule(_errno_action(errno.EPERM), name)
        for flag in CLONE_NEW.values():  # one rule per flag: rules on one syscall are or'ed
            rule(_errno_action(errno.EPERM), "clone", _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
        rule(_errno_action(errno.ENOSYS), "clone3")  # its flags sit in memory, out of the filter's sight
        fd = os.memfd_create("polar-seccomp-export", 0)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise SeccompError(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def seccomp_fd() -> int:
    """A fresh file descriptor holding the filter, for one bwrap (it reads it to the end); the caller
    passes it to the child and closes its own copy."""
    fd = os.memfd_create("polar-seccomp", 0)
    os.write(fd, seccomp_bpf())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
