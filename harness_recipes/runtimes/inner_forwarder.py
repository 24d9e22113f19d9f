"""The model API's way in, inside a sandbox: 127.0.0.1:PORT, the harness's connections piped to a Unix socket.

    python3 inner_forwarder.py PORT SOCKET [--callers NAME,NAME] -- HARNESS ARGV...

Run by the sandbox's own python3 (stdlib only, Python 3.8 and later: it is copied into the sandbox,
nothing of Polar is importable there; an instance image's python3 can be old). It binds the port
and claims the socket first (CLAIM: the host end then serves this process only, api_socket.py),
then starts the harness as its child and exits with the child's
status, so the forwarder lives exactly as long as the harness: a timeout or a kill of the process
group ends both. The sandbox has no network but its own loopback; the socket, bind-mounted from the
host, is the only way out, and the host end pipes it to the episode's proxy and nowhere else.
Connections are bounded (MAX_CONNECTIONS at once; more are closed at once).

Only the harness talks to the model. The agent's shell commands are the harness's descendants and
share its loopback, so a `curl` from its shell tool would otherwise reach the model with a prompt of
the agent's choosing, and the episode's reward would train it. Each connection's owner is found
from the kernel's tables, not from anything the client says: the peer port -> its socket inode
(/proc/net/tcp, tcp6) -> the processes holding that inode (/proc/<pid>/fd). Allowed: the harness
(this process's child) and, when the recipe declares `model_callers`, the harness's direct children
whose executable (/proc/<pid>/exe, else comm) has one of those names (a native binary a node wrapper
starts, a relaunched CLI). Every process holding the socket must be allowed; none found (a process
that hid its descriptors) is refused. A refused connection gets an HTTP 403 saying why, and is
reported to the host end (REFUSED), which counts it for the episode's record.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time

MAX_CONNECTIONS = 32
CHUNK = 65536
MAGIC = b"\x00POLAR"  # starts a forwarder's own message to the host end: no HTTP request starts so
CLAIM = MAGIC + b"claim\n"
REFUSED = MAGIC + b"refused "
CLAIMED = b"OK\n"
RETRIES = 3  # a fork between connect and lookup briefly shows a second holder: look again


def pipe(src, dst):
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _hex_addr(text):
    """(ip bytes, port) of a /proc/net/tcp address ("0100007F:1F90": little-endian words, then port)."""
    ip, port = text.split(":")
    raw = bytes.fromhex(ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return words, int(port, 16)


def _ip_bytes(ip):
    return socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)


def _same_ip(a, b):
    """Equal as IPv4, IPv4-mapped IPv6 included."""
    mapped = b"\0" * 10 + b"\xff\xff"
    a = a[12:] if len(a) == 16 and a.startswith(mapped) else a
    b = b[12:] if len(b) == 16 and b.startswith(mapped) else b
    return a == b


def socket_inode(peer, local, proc="/proc"):
    """The inode of the socket whose local end is ``peer`` and remote end ``local`` (both (ip, port)):
    the client's side of one accepted loopback connection. None when the kernel lists no such socket."""
    want_peer, want_local = (_ip_bytes(peer[0]), peer[1]), (_ip_bytes(local[0]), local[1])
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            (lip, lport), (rip, rport) = _hex_addr(cols[1]), _hex_addr(cols[2])
            if (lport == want_peer[1] and rport == want_local[1] and _same_ip(lip, want_peer[0])
                    and _same_ip(rip, want_local[0])):
                return int(cols[9])
    return None


def holders(inode, proc="/proc"):
    """The pids whose descriptors hold socket ``inode`` (those this process may read)."""
    target = f"socket:[{inode}]"
    out = set()
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"{proc}/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{proc}/{name}/fd/{fd}") == target:
                    out.add(int(name))
                    break
            except OSError:
                continue
    return out


def parent_of(pid, proc="/proc"):
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def names_of(pid, proc="/proc"):
    """The names a process goes by: its executable's file name (when readable) and its comm."""
    out = set()
    try:
        exe = os.readlink(f"{proc}/{pid}/exe")
        out.add(os.path.basename(exe[:-len(" (deleted)")] if exe.endswith(" (deleted)") else exe))
    except OSError:
        pass
    try:
        with open(f"{proc}/{pid}/comm") as f:
            out.add(f.read().strip())
    except OSError:
        pass
    return out


def caller_allowed(pid, harness, callers, proc="/proc"):
    """The harness itself, or a direct child of it named in ``callers`` (the recipe's model_callers)."""
    if pid == harness:
        return True
    return bool(callers) and parent_of(pid, proc) == harness and bool(names_of(pid, proc) & set(callers))


def judge(peer, local, harness, callers, proc="/proc"):
    """('', pids) when the connection from ``peer`` to ``local`` belongs to allowed callers only, else
    (why, pids)."""
    pids = set()
    for attempt in range(RETRIES):
        inode = socket_inode(peer, local, proc)
        if inode is None:
            why = f"no socket listed for {peer[0]}:{peer[1]}"
        else:
            pids = holders(inode, proc)
            if not pids:
                why = "the process holding this connection cannot be identified"
            else:
                bad = sorted(p for p in pids if not caller_allowed(p, harness, callers, proc))
                if not bad:
                    return "", pids
                names = {p: sorted(names_of(p, proc)) for p in bad}
                why = (f"the connection comes from {names} (pids {bad}), not from the harness (pid {harness})"
                       + (f" or its model_callers {sorted(callers)}" if callers else ""))
        if attempt + 1 < RETRIES:
            time.sleep(0.02)
    return why, pids


def refuse(conn, why):
    """An HTTP 403 naming why, after reading what the client sent (a reset would hide the answer)."""
    body = json.dumps({"error": {"type": "polar_model_api_refused", "message":
                                 "polar: only the harness talks to the model; calls from the agent's own commands "
                                 f"are refused ({why})"}}).encode()
    try:
        conn.settimeout(2)
        data = b""
        while b"\r\n\r\n" not in data and len(data) < CHUNK:
            got = conn.recv(CHUNK)
            if not got:
                break
            data += got
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def report(path, why, pids):
    """Tell the host end (it counts refusals for the episode's record); best effort."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(REFUSED + json.dumps({"why": why[:500], "pids": sorted(pids)}).encode() + b"\n")
            s.recv(16)
    except OSError:
        pass


def claim(path):
    """Make this process the socket's one client at the host end (api_socket.ApiSocket); '' or why not."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(path)
            s.sendall(CLAIM)
            answer = s.recv(16)
    except OSError as exc:
        return f"the model API socket {path} does not answer: {exc}"
    return "" if answer == CLAIMED else f"the host end refused the claim: {answer[:80]!r}"


def serve(conn, addr, path, slots, gate):
    try:
        why, pids = gate(addr)
        if why:
            report(path, why, pids)  # first: counted at the host before the caller even sees its 403
            refuse(conn, why)
            return
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(path)
        except OSError as exc:
            print(f"polar forwarder: the model API socket {path} does not answer: {exc}", file=sys.stderr)
            up.close()
            return
        back = threading.Thread(target=pipe, args=(up, conn), daemon=True)
        back.start()
        pipe(conn, up)
        back.join()
        up.close()
    finally:
        conn.close()
        slots.release()


def accept_loop(server, path, slots, gate):
    while True:
        try:
            conn, addr = server.accept()
        except OSError:
            return
        if not slots.acquire(blocking=False):
            conn.close()  # over the bound: refuse rather than queue without limit
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a relay must not add Nagle's delay
        threading.Thread(target=serve, args=(conn, addr, path, slots, gate), daemon=True).start()


def parse(argv):
    """(port, socket path, callers, harness argv) or a usage error (ValueError)."""
    if "--" not in argv:
        raise ValueError("no -- before the harness's command")
    cut = argv.index("--")
    head, cmd = argv[:cut], argv[cut + 1:]
    if len(head) not in (2, 4) or not cmd or (len(head) == 4 and head[2] != "--callers"):
        raise ValueError("expected PORT SOCKET [--callers NAME,...] -- ARGV...")
    callers = tuple(n for n in head[3].split(",") if n) if len(head) == 4 else ()
    return int(head[0]), head[1], callers, cmd


def main(argv):
    try:
        port, path, callers, cmd = parse(argv)
    except ValueError as exc:
        print(f"usage: inner_forwarder.py PORT SOCKET [--callers NAME,...] -- ARGV... ({exc})", file=sys.stderr)
        return 2
    server = socket.create_server(("127.0.0.1", port), backlog=MAX_CONNECTIONS)
    problem = claim(path)
    if problem:
        print(f"polar forwarder: {problem}; the harness is not started (it could not reach its model)",
              file=sys.stderr)
        return 125
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    harness = []  # the child's pid, once started: no connection is judged before it exists

    def gate(addr):
        if not harness:
            return "the harness has not started", set()
        return judge(addr[:2], ("127.0.0.1", port), harness[0], callers)
    threading.Thread(target=accept_loop, args=(server, path, slots, gate), daemon=True).start()
    try:
        child = subprocess.Popen(cmd)
    except OSError as exc:
        print(f"polar forwarder: cannot start {cmd[0]}: {exc}", file=sys.stderr)
        return 127
    harness.append(child.pid)
    rc = child.wait()
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
