#!/usr/bin/env python3
"""detection_matrix.py on driver runs whose figures hold nulls (a NaN a driver saw: its JSON
writer has no NaN), merged across two runs of the same classes, for the clean build and for a
mutant that never breached. The matrix must be written, with the nulls shown as non-finite.
Classes run on e4m3 pools (--kv_dtype e4m3) stay classes of their own, and --check holds them to
the rule of every realistic-traffic group.

    detection_matrix_test.py MUTANT_DRIVER
"""
import copy
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    driver = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        run = os.path.join(d, "clean.0.json")
        subprocess.run([driver, "--engine", "cpu", "--label", "clean", "--commit", "test",
                        "--prefixes", "64", "--pages", "64", "--drafts", "4", "--calls", "2",
                        "--drift", "--invariance_max_prefix", "256", "--json", run], check=True, stdout=subprocess.DEVNULL)
        with open(run) as f:
            first = json.load(f)
        assert first["classes"] and first["drift"], "the driver wrote no classes or no drift"
        second = copy.deepcopy(first)  # the same classes again: merged into one
        for c in second["classes"]:
            for k in c["max"]:
                c["max"][k] = None
        for drift in second["drift"].values():
            drift["max_ratio"] = None
        runs = {"clean.1.json": second}
        for i, r in enumerate((first, second)):  # a mutant that never breached: a survivor
            m = copy.deepcopy(r)
            m["label"] = "survivor"
            runs[f"survivor.{i}.json"] = m
        for name, r in runs.items():
            with open(os.path.join(d, name), "w") as f:
                json.dump(r, f)
        files = sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".json"))
        out = os.path.join(d, "out")
        p = subprocess.run([sys.executable, os.path.join(HERE, "detection_matrix.py"),
                            "--out", out, "--name", "m", "--patches", d] + files,
                           capture_output=True, text=True)
        assert p.returncode == 0, f"detection_matrix.py failed:\n{p.stdout}{p.stderr}"
        with open(os.path.join(out, "m.md")) as f:
            md = f.read()
        with open(os.path.join(out, "m.json")) as f:
            doc = json.load(f)
        clean = doc["mutants"]["clean"]
        assert clean["calls"] == 2 * first["calls"], clean["calls"]
        assert all(v is None for c in clean["classes"] for v in c["max"].values()), \
            "a merged figure lost the null of the run that saw a NaN"
        assert "| survivor |" in md and "non-finite" in md, md
        assert first["invariance"]["checks"] == 12 and not first["invariance"]["failures"], \
            first["invariance"]
        assert "| invariance |" in md and "## Invariance checks on the clean kernel" in md, md

        # With --check: a mutant the invariance probes alone caught passes the check; one that
        # nothing caught fails it.
        check = os.path.join(d, "allowed.txt")
        open(check, "w").close()
        caught = copy.deepcopy(first)
        caught["label"] = "inv_only"
        caught["invariance"]["failures"] = 1
        caught["invariance"]["failed"] = ["invariance/ragged/split_plan"]
        caught["invariance"]["first_reason"] = "invariance/ragged/split_plan: row rel-L2 0.1"
        with open(os.path.join(d, "inv_only.0.json"), "w") as f:
            json.dump(caught, f)
        base = [os.path.join(d, "clean.0.json"), os.path.join(d, "inv_only.0.json")]
        p = subprocess.run([sys.executable, os.path.join(HERE, "detection_matrix.py"),
                            "--out", out, "--name", "c", "--patches", d, "--check", check] + base,
                           capture_output=True, text=True)
        assert p.returncode == 0, f"a mutant caught by invariance failed the check:\n{p.stdout}"
        with open(os.path.join(out, "c.md")) as f:
            assert "| inv_only |" in f.read()
        p = subprocess.run([sys.executable, os.path.join(HERE, "detection_matrix.py"),
                            "--out", out, "--name", "s", "--patches", d, "--check", check] +
                           base + [os.path.join(d, "survivor.0.json")],
                           capture_output=True, text=True)
        assert p.returncode == 1 and "survivor undetected" in p.stdout, p.stdout

        # The same classes on e4m3 pools: not merged into the bf16 ones, a column of their own.
        e4m3_run = os.path.join(d, "e4m3", "clean.e4m3.json")
        os.makedirs(os.path.dirname(e4m3_run))
        subprocess.run([driver, "--engine", "cpu", "--label", "clean", "--commit", "test",
                        "--prefixes", "64", "--pages", "64", "--drafts", "4", "--calls", "2",
                        "--kv_dtype", "e4m3", "--kv_scale", "0.37", "--json", e4m3_run],
                       check=True, stdout=subprocess.DEVNULL)
        with open(e4m3_run) as f:
            e4m3 = json.load(f)
        assert all(c["kv_dtype"] == "e4m3" and abs(c["kv_scale"] - 0.37) < 1e-6
                   for c in e4m3["classes"]), e4m3["classes"]
        assert all(c["kv_dtype"] == "bf16" for c in first["classes"]), first["classes"]
        base = [os.path.join(d, "clean.0.json"), e4m3_run]
        p = subprocess.run([sys.executable, os.path.join(HERE, "detection_matrix.py"),
                            "--out", out, "--name", "e", "--patches", d] + base,
                           capture_output=True, text=True)
        assert p.returncode == 0, f"detection_matrix.py failed:\n{p.stdout}{p.stderr}"
        with open(os.path.join(out, "e.json")) as f:
            doc = json.load(f)
        clean = doc["mutants"]["clean"]
        assert len(clean["classes"]) == len(first["classes"]) + len(e4m3["classes"]), \
            "e4m3 classes merged into the bf16 classes of their shape"
        assert clean["calls"] == first["calls"] + e4m3["calls"], clean["calls"]
        with open(os.path.join(out, "e.md")) as f:
            md = f.read()
        assert "| realistic e4m3x0.37 64 |" in md and "| realistic 64 |" in md, md

        # A mutant caught per call on bf16 pools but on no e4m3 class, by nothing else: it fails
        # the check, naming the e4m3 traffic.
        blind = copy.deepcopy(first)
        blind["label"] = "fp8_blind"
        for c in blind["classes"]:
            c["breaches"] = c["calls"]
            c["first_breach_call"] = 1
        blind_e4m3 = copy.deepcopy(e4m3)
        blind_e4m3["label"] = "fp8_blind"
        for name, r in (("fp8_blind.0.json", blind), ("fp8_blind.1.json", blind_e4m3)):
            with open(os.path.join(d, "e4m3", name), "w") as f:
                json.dump(r, f)
        p = subprocess.run([sys.executable, os.path.join(HERE, "detection_matrix.py"),
                            "--out", out, "--name", "b", "--patches", d, "--check", check] + base +
                           [os.path.join(d, "e4m3", n) for n in ("fp8_blind.0.json",
                                                                 "fp8_blind.1.json")],
                           capture_output=True, text=True)
        assert p.returncode == 1, p.stdout
        assert "fp8_blind undetected on realistic e4m3x0.37 traffic at prefix 64" in p.stdout, \
            p.stdout
        assert "fp8_blind undetected on realistic traffic" not in p.stdout, p.stdout
    print("ok: nulls merge as non-finite, the matrix is written, invariance catches count, "
          "e4m3 classes stay apart")
    return 0


if __name__ == "__main__":
    sys.exit(main())
