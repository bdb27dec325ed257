#!/usr/bin/env python3
"""shm regions and call channels with verifyd and its client as two users, the deployment the
systemd unit and the DaemonSet document: verifyd runs as its own user in its group, the serving
stack as another user that is a member of that group (supplementary, as `usermod -aG` and
`supplementalGroups` make it).

two_users_test.py VERIFYD VERIFYCTL, as root: creates the group verifyd-t and the users
verifyd-t-daemon (in it), verifyd-t-client and verifyd-t-client2 (each in a group of its own and
in verifyd-t), starts verifyd as verifyd-t-daemon and checks, as verifyd-t-client, that
`verifyctl send` through shm regions and call channels and the Python client's shm transport and
channels are served and give the inline transport's outputs bit for bit; then, as
verifyd-t-client2, that verifyd refuses to map verifyd-t-client's object, which the group may open
but verifyd maps only for its owner. The users and the group are removed at the end.

Exits 77 (CTest's skip code) when not root, or when setpriv, useradd, grpc, protobuf, numpy or the
generated stubs are missing.
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))
SKIP = 77
GROUP = "verifyd-t"
DAEMON, CLIENT_USER, CLIENT2 = "verifyd-t-daemon", "verifyd-t-client", "verifyd-t-client2"
SHAPE = ["--shape", "2,3,8,54", "--page_size", "16"]


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def run(*cmd, check=True):
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def as_user(user, group, *cmd):
    """cmd as ``user`` with primary group ``group`` and the user's supplementary groups."""
    return ["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups", "--", *cmd]


def remove_accounts():
    for user in (CLIENT2, CLIENT_USER, DAEMON):
        if run("getent", "passwd", user, check=False).returncode == 0:
            uid = int(run("id", "-u", user).stdout)
            # userdel leaves POSIX shared memory behind; a killed run may have left some.
            for name in os.listdir("/dev/shm"):
                path = os.path.join("/dev/shm", name)
                try:
                    if os.lstat(path).st_uid == uid:
                        os.unlink(path)
                except FileNotFoundError:
                    pass
            run("userdel", user)
    for group in (CLIENT2, CLIENT_USER, GROUP):
        if run("getent", "group", group, check=False).returncode == 0:
            run("groupdel", group)


def create_accounts():
    remove_accounts()  # a killed run's accounts may have other groups
    nologin = "/usr/sbin/nologin"
    run("groupadd", GROUP)
    run("useradd", "--no-create-home", "--shell", nologin, "--gid", GROUP, DAEMON)
    for user in (CLIENT_USER, CLIENT2):
        run("useradd", "--no-create-home", "--shell", nologin, "--user-group", "--groups", GROUP,
            user)


class Daemon:
    """verifyd as DAEMON, its Unix sockets in ``run_dir`` (owned by DAEMON, 0750, as the unit's
    /run/verifyd)."""

    def __init__(self, verifyd, verifyctl, run_dir):
        self.data = f"unix:{run_dir}/verifyd.sock"
        self.admin = f"unix:{run_dir}/admin.sock"
        self.verifyctl = verifyctl
        self.log_path = os.path.join(run_dir, "log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(as_user(
                DAEMON, GROUP, verifyd, f"--listen={self.data}", f"--admin_listen={self.admin}",
                "--metrics_address=127.0.0.1:0", f"--state_dir={run_dir}/state",
                "--engine=cpu", "--cpu_threads=2", "--capture_dir=off", "--probe=false",
                "--data_socket_mode=0660"), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"verifyd exited with {self.proc.returncode}:\n{self.log()}")
            if run(verifyctl, f"--target={self.data}", f"--admin={self.admin}", "status",
                   check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"verifyd did not start in 120 s:\n{self.log()}")

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_verifyctl(daemon, failures):
    """`verifyctl send` as CLIENT_USER through each way its objects reach verifyd."""
    for extra in (["--transport", "shm", "--check"], ["--channel"],
                  ["--channel", "--transport", "shm", "--check"]):
        what = "verifyctl send " + " ".join(extra)
        r = run(*as_user(CLIENT_USER, CLIENT_USER, daemon.verifyctl, f"--target={daemon.data}",
                         "send", "--count", "2", *SHAPE, *extra, "--json"), check=False)
        try:
            j = json.loads(r.stdout)
        except ValueError:
            j = {}
        ok = r.returncode == 0 and j.get("ok") == 2
        if "--check" in extra:
            ok = ok and j.get("checked") == 2
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(f"{what}: exit {r.returncode}\n{r.stdout}{r.stderr}")


def check_python(daemon, py_dir, role, failures, *args):
    """This script's ``role`` as CLIENT_USER (``client``) or CLIENT2 (``refuse``)."""
    user = CLIENT_USER if role == "client" else CLIENT2
    env = dict(os.environ, VERIFYD_CLIENT_GEN=os.path.join(py_dir, "gen"),
               PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run(as_user(user, user, sys.executable, os.path.join(py_dir, "two_users_test.py"),
                               f"--{role}", daemon.data, *args),
                       capture_output=True, text=True, env=env, check=False)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        failures.append(f"python --{role}: exit {r.returncode}\n{r.stdout}{r.stderr}")


def client_role(target):
    """As CLIENT_USER: the Python client's shm transport and a call channel give the inline
    transport's outputs, and its objects are open to the socket's group only."""
    import numpy as np  # noqa: PLC0415
    from random_bundles import random_bundle  # noqa: PLC0415
    from verifyd_client import VerifyClient  # noqa: PLC0415

    rng = np.random.default_rng(22)
    bundles = [random_bundle(rng, 2, 3, 8, 16, [54, 37]) for _ in range(2)]
    socket_gid = os.stat(target[len("unix:"):]).st_gid
    failures = []
    with VerifyClient(target, timeout=60) as inline, \
            VerifyClient(target, timeout=60, transport="shm") as shm:
        want = [inline.verify(**b).o for b in bundles]
        pool = shm.register_kv_pool(bundles[0]["kv_pool"])
        got = shm.verify(**dict(bundles[0], kv_pool=pool)).o
        ok = np.array_equal(got, want[0])
        for name in os.listdir("/dev/shm"):
            try:
                st = os.stat(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                continue
            if st.st_uid == os.getuid() and (st.st_mode & 0o777 != 0o660 or
                                             st.st_gid != socket_gid):
                ok = False
                failures.append(f"/dev/shm/{name}: mode {st.st_mode & 0o777:o}, gid "
                                f"{st.st_gid}, not 660 and the socket's {socket_gid}")
        print(f"{'ok  ' if ok else 'FAIL'} python shm transport")
        with shm.channel(byte_size=1 << 20) as ch:
            ok_ch = all(np.array_equal(ch.verify(**b).o, w)
                        for b, w in zip(bundles, want))
        print(f"{'ok  ' if ok_ch else 'FAIL'} python call channel (shm transport)")
        with inline.channel(byte_size=1 << 20) as ch:
            ok_inline_ch = np.array_equal(ch.verify(**bundles[1]).o, want[1])
        print(f"{'ok  ' if ok_inline_ch else 'FAIL'} python call channel (inline transport)")
    for f in failures:
        print(f)
    return 0 if ok and ok_ch and ok_inline_ch else 1


def refuse_role(target, key, owner_uid, build):
    """As CLIENT2, a member of the group too: verifyd neither registers nor opens as a channel
    (a call channel, or a switch channel with verifyd's own ``build``) an object of
    CLIENT_USER's, though the group may open it."""
    import grpc  # noqa: PLC0415
    from verifyd_client import VerifyClient  # noqa: PLC0415
    from verifyd_client._proto import verify_pb2  # noqa: PLC0415

    failures = []
    with VerifyClient(target, timeout=60) as c:
        stub = c._stub  # noqa: SLF001 - the raw calls, with another user's key
        for what, call in (
                ("RegisterShmRegion", lambda: stub.RegisterShmRegion(
                    verify_pb2.RegisterShmRegionRequest(name="stolen", key=key, offset=0,
                                                        byte_size=1 << 16, client="t"),
                    timeout=60)),
                ("OpenChannel", lambda: stub.OpenChannel(
                    verify_pb2.OpenChannelRequest(name="stolen", key=key, byte_size=1 << 16,
                                                  client="t"), timeout=60)),
                ("OpenChannel (switch mode)", lambda: stub.OpenChannel(
                    verify_pb2.OpenChannelRequest(
                        name="stolen-switch", key=key, byte_size=1 << 16, client="t",
                        serving_switch=verify_pb2.SwitchSpec(layers=61, model="m", build=build)),
                    timeout=60))):
            try:
                call()
                failures.append(f"{what} of another user's object was accepted")
                continue
            except grpc.RpcError as e:
                refused = (e.code() == grpc.StatusCode.PERMISSION_DENIED and
                           f"belongs to uid {owner_uid}," in e.details())
                if not refused:
                    failures.append(f"{what}: {e.code().name}: {e.details()}")
            print(f"{'ok  ' if refused else 'FAIL'} {what} of another member's object refused")
    for f in failures:
        print(f)
    return 1 if failures else 0


def setup_python(py_dir):
    """The client package, its stubs and the bundle generator where every test user can read
    them (the checkout may be in a home directory)."""
    gen = os.environ.get("VERIFYD_CLIENT_GEN", "")
    if not os.path.isfile(os.path.join(gen, "verifyd", "v1", "verify_pb2.py")):
        gen = os.path.join(py_dir, "gen")
        r = run(os.path.join(CLIENT, "generate.sh"), gen, check=False)
        if r.returncode != 0:
            skip(f"no generated stubs and generate.sh failed: {r.stderr.strip()}")
    else:
        shutil.copytree(gen, os.path.join(py_dir, "gen"))
    shutil.copytree(os.path.join(CLIENT, "verifyd_client"), os.path.join(py_dir, "verifyd_client"),
                    ignore=shutil.ignore_patterns("__pycache__", "_gen"))
    for f in ("two_users_test.py", "random_bundles.py"):
        shutil.copy(os.path.join(HERE, f), py_dir)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        sys.path[:0] = [HERE]
        return client_role(sys.argv[2])
    if len(sys.argv) == 6 and sys.argv[1] == "--refuse":
        sys.path[:0] = [HERE]
        return refuse_role(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    if os.geteuid() != 0:
        skip("needs root to create the users")
    for tool in ("setpriv", "useradd", "userdel", "groupadd", "groupdel"):
        if shutil.which(tool) is None:
            skip(f"no {tool} (Debian: util-linux, passwd)")
    for mod in ("grpc", "google.protobuf", "numpy"):
        if run(sys.executable, "-c", f"import {mod}", check=False).returncode != 0:
            skip(f"{sys.executable} has no '{mod}'")
    verifyd, verifyctl = (os.path.abspath(p) for p in sys.argv[1:3])
    # The accounts are global: one run at a time on a host.
    with open("/tmp/verifyd-two-users-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        base = tempfile.mkdtemp(prefix="verifyd-two-users-")
        daemon = None
        failures = []
        try:
            os.chmod(base, 0o755)
            bin_dir, py_dir, run_dir = (os.path.join(base, d) for d in ("bin", "py", "run"))
            # Copies every test user can execute, wherever the build is.
            os.mkdir(bin_dir)
            verifyd = shutil.copy(verifyd, bin_dir)
            verifyctl = shutil.copy(verifyctl, bin_dir)
            os.mkdir(py_dir)
            setup_python(py_dir)
            create_accounts()
            probe = run(*as_user(CLIENT_USER, CLIENT_USER, sys.executable, "-c",
                                 "import grpc, google.protobuf, numpy"), check=False)
            if probe.returncode != 0:
                skip(f"{CLIENT_USER} cannot run {sys.executable} with grpc, protobuf and numpy: "
                     f"{probe.stderr.strip()}")
            os.mkdir(run_dir, 0o750)
            shutil.chown(run_dir, DAEMON, GROUP)
            daemon = Daemon(verifyd, verifyctl, run_dir)
            check_verifyctl(daemon, failures)
            check_python(daemon, py_dir, "client", failures)
            # An object of CLIENT_USER's as its client makes it: 0660 in the socket's group.
            key = f"/verifyd-t-{os.getpid()}"
            fd = os.open("/dev/shm" + key, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, 1 << 16)
                uid = int(run("id", "-u", CLIENT_USER).stdout)
                os.fchown(fd, uid, int(run("getent", "group", GROUP).stdout.split(":")[2]))
                os.fchmod(fd, 0o660)
                build = run(verifyd, "--version").stdout.split("(commit ")[1].split(")")[0]
                check_python(daemon, py_dir, "refuse", failures, key, str(uid), build)
            finally:
                os.close(fd)
                os.unlink("/dev/shm" + key)
        finally:
            if daemon is not None:
                daemon.stop()
                if failures:
                    print(f"verifyd's log:\n{daemon.log()}")
            remove_accounts()
            shutil.rmtree(base, ignore_errors=True)
    for f in failures:
        print(f"FAIL: {f}")
    print("FAILED" if failures else "PASSED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
