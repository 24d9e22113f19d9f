"""The model API's way in, inside a sandbox: listen on 127.0.0.1:PORT, pipe each connection to a Unix socket.

    python3 inner_forwarder.py PORT SOCKET -- HARNESS ARGV...

Run by the sandbox's own python3 (stdlib only: it is copied into the sandbox, nothing of Polar is
importable there). It binds the port first, then starts the harness as its child and exits with the
child's status, so the forwarder lives exactly as long as the harness: a timeout or a kill of the
process group ends both. The sandbox has no network but its own loopback; the socket, bind-mounted
from the host, is the only way out, and the host end pipes it to the episode's proxy and nowhere else.
Connections are bounded (MAX_CONNECTIONS at once; more are closed at once).
"""
import socket
import subprocess
import sys
import threading

MAX_CONNECTIONS = 32
CHUNK = 65536


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


def serve(conn, path, slots):
    try:
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


def accept_loop(server, path, slots):
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        if not slots.acquire(blocking=False):
            conn.close()  # over the bound: refuse rather than queue without limit
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a relay must not add Nagle's delay
        threading.Thread(target=serve, args=(conn, path, slots), daemon=True).start()


def main(argv):
    if len(argv) < 4 or argv[2] != "--":
        print("usage: inner_forwarder.py PORT SOCKET -- ARGV...", file=sys.stderr)
        return 2
    port, path, cmd = int(argv[0]), argv[1], argv[3:]
    server = socket.create_server(("127.0.0.1", port), backlog=MAX_CONNECTIONS)
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    threading.Thread(target=accept_loop, args=(server, path, slots), daemon=True).start()
    try:
        child = subprocess.Popen(cmd)
    except OSError as exc:
        print(f"polar forwarder: cannot start {cmd[0]}: {exc}", file=sys.stderr)
        return 127
    rc = child.wait()
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
