#!/usr/bin/env python3
"""Runs the command blocks of the docs as a newcomer pastes them, against the build under test.

    run_doc_blocks.py REPO BUILD_DIR DOC.md [DOC.md ...]
    run_doc_blocks.py --check-only REPO BUILD_DIR DOC.md [DOC.md ...]   (the markers alone)

Every ```sh and ```python block of a doc must follow a marker comment (blank lines between
them are allowed), else the test fails:

  <!-- run: GROUP ... -->     the harness runs the block, in order with the other blocks of
                              GROUP (one shell state and one Python namespace per group);
  <!-- daemon: GROUP ... -->  the block is one command that starts verifyd (scripts/run.sh or
                              verifyd itself): the harness starts it in the background, or
                              restarts it when GROUP's daemon runs, and waits until it serves;
  <!-- needs: WHAT ... -->    not run here: WHAT is gpu (a GPU machine), cluster (Kubernetes),
                              docker (a container tool) or root (a host's systemd, as root);
  <!-- tested-by: TEST ... --> not run here: the named test runs the same commands;
  <!-- ci: ... -->            the block is the CI lane itself (scripts/test.sh).

A run or daemon marker may name what the block must show: each expect "TEXT" in it must be in
the block's output (a daemon block's: verifyd's log since it started), so that a story the doc
tells (a rollback and its reason) is checked, not only that its commands exit 0.

Each group runs in a directory laid out like the checkout (its top-level entries linked, build/
this build, run/ empty), with build/src/cli and build/src/main on PATH. A group without a daemon
block gets a verifyd of its own (CPU engine, sockets in run/, a gate of 2 clean comparisons).
A marker NAME-daemon: is a daemon block of group NAME and NAME-WORD: a run block of it (the
README's TLS example, tls-setup, tls-daemon, tls-client, which tests/cli/tls_example_test.sh
also runs). What the docs name as fixed is made the group's own:

  - the ports 50051, 50052, 50443, 50444 and 9464 of 127.0.0.1 and localhost become free
    ports;
  - /run/verifyd/ (the systemd unit's sockets) becomes the group's run/ directory;
  - scripts/run.sh runs the binaries as built (RUN_NO_BUILD=1) and its ports follow the above.

Python blocks run with verifyd_client on the path and a prelude that defines the names the
client's examples use (q, kv_pool, ..., bundle, steps: a small random bundle) and, when the
group's daemon is up, sends it two compared calls so that its gate is open.
A failing line (sh) or block (python) ends the test with its output and the daemon's log.
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

MARKER = re.compile(r"^<!--\s*([a-z][a-z0-9-]*):\s*(\S*)(.*?)-->\s*$")
KINDS = ("run", "daemon", "needs", "tested-by", "ci")
FENCE = re.compile(r"^```(sh|python)\s*$")
NEEDS = ("gpu", "cluster", "docker", "root")
FIXED_PORTS = ("50051", "50052", "50443", "50444", "9464")

PRELUDE = r'''
import os, types
import numpy as np
from random_bundles import random_bundle
from verifyd_client import VerifyClient as _VerifyClient
_b = random_bundle(np.random.default_rng(7), batch=2, draft=4, heads=8, page_size=16,
                   prefixes=[40, 7])
q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale = (
    _b[k] for k in ("q", "kv_pool", "kv_indptr", "kv_indices", "kv_lens", "tree_mask",
                    "sm_scale"))
bundle = dict(_b)
steps = [types.SimpleNamespace(bundle=dict(_b), id=f"step-{i}") for i in range(3)]
num_pages, page_size = kv_pool.shape[0], kv_pool.shape[1]
pages, new_pages = np.arange(num_pages), kv_pool
if os.path.exists("run/verifyd.sock"):
    with _VerifyClient("unix:run/verifyd.sock", timeout=60) as _c:
        for _ in range(2):
            _c.verify(**_b, compare_sync=True)
'''

WORKER = r'''
import json, sys, traceback
ns = {"__name__": "__main__"}
for line in sys.stdin:
    code = json.loads(line)
    try:
        exec(compile(code, "<doc block>", "exec"), ns)
        ok = True
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        ok = False
    sys.stdout.flush()
    sys.stderr.flush()
    print("\n__BLOCK_DONE__ " + ("ok" if ok else "fail"), flush=True)
'''


class Block:
    def __init__(self, doc, line, kind, group, note, lang, text):
        self.doc, self.line, self.kind, self.group = doc, line, kind, group
        self.note, self.lang, self.text = note.strip(), lang, text

    def where(self):
        return f"{self.doc}:{self.line}"


def parse(path, rel):
    """The doc's command blocks, each with its marker; unmarked ones have kind None."""
    blocks = []
    lines = open(path, encoding="utf-8").read().split("\n")
    marker = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        f = FENCE.match(line)
        if m:
            marker = _marker(*m.groups())
        elif f:
            body = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            kind, group, note = marker if marker else (None, "", "")
            blocks.append(Block(rel, i - len(body), kind, group, note, f.group(1),
                                "\n".join(body)))
            marker = None
        elif line.strip() and not line.startswith("<!--"):
            marker = None
        i += 1
    return blocks


def _marker(kind, first, rest):
    """(kind, group, note) of a marker. Besides the kinds above, a marker NAME-daemon: (the
    README's TLS example, which tests/cli/tls_example_test.sh also runs) is a daemon block of
    group NAME, and NAME-WORD: a run block of group NAME."""
    if kind in KINDS:
        return kind, first, rest
    if "-" in kind:
        group, word = kind.split("-", 1)
        return ("daemon" if word == "daemon" else "run"), group, f"{first}{rest}"
    return kind, first, rest


def check_marks(blocks):
    errors = []
    for b in blocks:
        if b.kind is not None and b.kind not in KINDS:
            errors.append(f"{b.where()}: unknown marker '{b.kind}:' (one of {', '.join(KINDS)})")
        elif b.kind is None:
            errors.append(f"{b.where()}: ```{b.lang} block without a marker (<!-- run: GROUP -->, "
                          f"<!-- needs: gpu|cluster|docker|root -->, ...; see {__file__})")
        elif b.kind in ("run", "daemon") and not b.group:
            errors.append(f"{b.where()}: <!-- {b.kind}: --> needs a group name")
        elif b.kind == "needs" and b.group not in NEEDS:
            errors.append(f"{b.where()}: needs '{b.group}' is not one of {', '.join(NEEDS)}")
        elif b.kind == "daemon" and b.lang != "sh":
            errors.append(f"{b.where()}: a daemon block is a ```sh block")
    return errors


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logical_lines(text):
    """The block's commands: blank lines dropped, backslash continuations joined."""
    out, cur = [], ""
    for line in text.split("\n"):
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur)
        cur = ""
    if cur.strip():
        out.append(cur)
    return out


class Failure(Exception):
    pass


class Group:
    def __init__(self, name, repo, build, base):
        self.name, self.repo, self.build = name, repo, build
        self.dir = os.path.join(base, name)
        os.makedirs(os.path.join(self.dir, "run"))
        for entry in os.listdir(repo):
            if entry in ("build", "run") or entry.startswith("."):
                continue
            os.symlink(os.path.join(repo, entry), os.path.join(self.dir, entry))
        os.symlink(build, os.path.join(self.dir, "build"))
        self.ports = {p: str(free_port()) for p in FIXED_PORTS}
        self.env_file = os.path.join(self.dir, ".env")
        self.log_path = os.path.join(self.dir, "verifyd.log")
        self.daemon = None
        self.python = None
        env = dict(os.environ)
        env["PATH"] = f"{build}/src/cli:{build}/src/main:{env.get('PATH', '')}"
        env.update(RUN_NO_BUILD="1", BUILD_DIR=os.path.join(self.dir, "build"),
                   RUN_DIR=os.path.join(self.dir, "run"),
                   RUN_TCP=f"127.0.0.1:{self.ports['50051']}",
                   RUN_METRICS=f"127.0.0.1:{self.ports['9464']}",
                   PYTHONPATH=f"{repo}/clients/python:{repo}/tests/python",
                   PYTHONDONTWRITEBYTECODE="1")
        env.setdefault("VERIFYD_CLIENT_GEN", f"{build}/clients/python/gen")
        for k in ("VERIFYD_TARGET", "VERIFYD_ADMIN", "VERIFYD_TLS_CA_FILE",
                  "VERIFYD_TLS_CERT_FILE", "VERIFYD_TLS_KEY_FILE"):
            env.pop(k, None)
        self.env = env
        with open(self.env_file, "w") as f:
            f.write(f"cd {shlex.quote(self.dir)}\n")

    def own(self, text):
        """The block as it runs here: the fixed ports and /run/verifyd/ made the group's own."""
        for fixed, port in self.ports.items():
            text = re.sub(rf"\b(127\.0\.0\.1|localhost):{fixed}\b", rf"\g<1>:{port}", text)
        return text.replace("/run/verifyd/", os.path.join(self.dir, "run") + "/")

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return "(no log)"

    def fail(self, what, output=""):
        raise Failure(f"{what}\n{output}\n--- verifyd's log ({self.name})\n"
                      + "\n".join(self.log().splitlines()[-40:]))

    # The daemon.
    def start_default(self):
        run = os.path.join(self.dir, "run")
        self.start(f"verifyd --listen=unix:{run}/verifyd.sock --admin_listen=unix:{run}/admin.sock "
                   f"--metrics_address=127.0.0.1:0 --state_dir={run}/state --engine=cpu "
                   f"--cpu_threads=2 --gate_window=2", "the group's verifyd")

    def expect(self, block, output):
        for want in re.findall(r'expect\s+"([^"]*)"', block.note):
            if want not in output:
                self.fail(f"{block.where()}: the output lacks \"{want}\"", output)

    def start(self, command, where):
        self.stop()
        with open(self.log_path, "a") as log:
            start = log.tell()
            print(f"  [{where}] starting: {command}", flush=True)
            self.daemon = subprocess.Popen(
                ["bash", "-c", f"source {shlex.quote(self.env_file)}; exec {command}"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                self.fail(f"{where}: verifyd exited with {self.daemon.returncode}: {command}")
            with open(self.log_path, errors="replace") as f:
                f.seek(start)
                log = f.read()
                if re.search(r"\] mode \w+, state in ", log):
                    return log
            time.sleep(0.1)
        self.fail(f"{where}: verifyd did not start in 120 s: {command}")

    def stop(self):
        if self.daemon is None or self.daemon.poll() is not None:
            self.daemon = None
            return
        os.killpg(self.daemon.pid, signal.SIGTERM)
        try:
            self.daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait()
        self.daemon = None

    # The blocks.
    def run_sh(self, block):
        script = ["set -o pipefail", f"source {shlex.quote(self.env_file)}"]
        for line in logical_lines(self.own(block.text)):
            q = shlex.quote(line)
            script += [f"printf '$ %s\\n' {q}", line,
                       f"rc=$?; if [ $rc -ne 0 ]; then printf 'FAILED (exit %s): %s\\n' $rc {q}; "
                       f"exit 1; fi"]
        script += [f"{{ export -p; printf 'cd %q\\n' \"$PWD\"; }} >{shlex.quote(self.env_file)}"]
        r = subprocess.run(["bash", "-c", "\n".join(script)], env=self.env, cwd=self.dir,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=400, check=False)
        print(_indent(r.stdout), flush=True)
        if r.returncode != 0:
            self.fail(f"{block.where()}: a line of the block failed")
        self.expect(block, r.stdout)

    def run_python(self, block):
        if self.python is None:
            # Started with the exports of the group's sh blocks so far.
            cmd = (f"source {shlex.quote(self.env_file)}; "
                   f"exec {shlex.quote(sys.executable)} -u -c {shlex.quote(WORKER)}")
            self.python = subprocess.Popen(["bash", "-c", cmd], env=self.env,
                                           cwd=self.dir, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True)
            self._exec(PRELUDE, f"{block.where()} (the harness's prelude)", show=False)
        self._exec(self.own(block.text), block.where())

    def _exec(self, code, where, show=True):
        if show:
            print(_indent(">>> " + code.strip().replace("\n", "\n... ")), flush=True)
        self.python.stdin.write(json.dumps(code) + "\n")
        self.python.stdin.flush()
        out = []
        for line in self.python.stdout:
            if line.startswith("__BLOCK_DONE__"):
                if line.split()[1] != "ok":
                    self.fail(f"{where}: the Python block failed", "".join(out))
                print(_indent("".join(out)), flush=True)
                return
            out.append(line)
        self.fail(f"{where}: the Python worker exited", "".join(out))

    def close(self):
        if self.python is not None:
            self.python.stdin.close()
            self.python.wait()
        self.stop()


def _indent(text):
    return "\n".join("    " + l for l in text.rstrip().split("\n")) if text.strip() else ""


def main():
    args = sys.argv[1:]
    check_only = bool(args) and args[0] == "--check-only"
    if check_only:
        args = args[1:]
    if len(args) < 3:
        print(__doc__)
        return 2
    repo, build, docs = os.path.abspath(args[0]), os.path.abspath(args[1]), args[2:]
    blocks = []
    for doc in docs:
        blocks += parse(os.path.join(repo, doc), doc)
    errors = check_marks(blocks)
    if errors:
        print("FAIL: unmarked or badly marked blocks:\n  " + "\n  ".join(errors))
        return 1
    if check_only:
        print(f"PASS: the {len(blocks)} command blocks of {len(docs)} docs are marked")
        return 0
    with_daemon = {b.group for b in blocks if b.kind == "daemon"}
    base = tempfile.mkdtemp(prefix="verifyd-docs-")
    groups = {}
    ran = 0
    try:
        for b in blocks:
            if b.kind not in ("run", "daemon"):
                print(f"- {b.where()}: not run here ({b.kind}: {b.group} {b.note})".rstrip())
                continue
            print(f"- {b.where()}: {b.kind} {b.group}", flush=True)
            g = groups.get(b.group)
            if g is None:
                g = groups[b.group] = Group(b.group, repo, build, base)
                if b.group not in with_daemon:
                    g.start_default()
            if b.kind == "daemon":
                cmds = logical_lines(g.own(b.text))
                if len(cmds) != 1:
                    g.fail(f"{b.where()}: a daemon block holds one command, not {len(cmds)}")
                g.expect(b, g.start(cmds[0], b.where()))
            elif b.lang == "sh":
                g.run_sh(b)
            else:
                g.run_python(b)
            ran += 1
    except Failure as e:
        print(f"FAIL: {e}")
        return 1
    finally:
        for g in groups.values():
            g.close()
        shutil.rmtree(base, ignore_errors=True)
    print(f"PASS: {ran} blocks of {', '.join(docs)} ran "
          f"({len(blocks) - ran} marked as run elsewhere)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
