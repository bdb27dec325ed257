#!/usr/bin/env python3
"""detection_matrix.py on driver runs whose figures hold nulls (a NaN a driver saw: its JSON
writer has no NaN), merged across two runs of the same classes, for the clean build and for a
mutant that never breached. The matrix must be written, with the nulls shown as non-finite.

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
    print("ok: nulls merge as non-finite, the matrix is written, invariance catches count")
    return 0


if __name__ == "__main__":
    sys.exit(main())
