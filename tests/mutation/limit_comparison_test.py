#!/usr/bin/env python3
"""limit_comparison.py on two matrices of the same driver run: a clean build and a mutant whose
classes no call breached under the first tolerance, one of which a call breached under the
second. The comparison must name the change of tolerance, count that class as newly caught and
mark its group; matrices of different calls must be refused.

    limit_comparison_test.py MUTANT_DRIVER
"""
import copy
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def matrix(d, name, runs):
    """detection_matrix.py over driver runs {file: json}; returns the matrix's path."""
    run_dir = os.path.join(d, name)
    os.makedirs(run_dir)
    for file, r in runs.items():
        with open(os.path.join(run_dir, file), "w") as f:
            json.dump(r, f)
    files = sorted(os.path.join(run_dir, n) for n in runs)
    subprocess.run([sys.executable, os.path.join(HERE, "detection_matrix.py"), "--out", d,
                    "--name", name, "--patches", d] + files, check=True, stdout=subprocess.DEVNULL)
    return os.path.join(d, name + ".json")


def main():
    driver = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        run = os.path.join(d, "clean.json")
        subprocess.run([driver, "--engine", "cpu", "--label", "clean", "--commit", "test",
                        "--prefixes", "64,130", "--pages", "16", "--drafts", "4", "--calls", "2",
                        "--max_lse_abs", "0.01", "--json", run],
                       check=True, stdout=subprocess.DEVNULL)
        with open(run) as f:
            clean = json.load(f)
        assert clean["tolerance"]["max_lse_abs"] == 0.01, clean["tolerance"]
        mutant = copy.deepcopy(clean)
        mutant["label"] = "draft_bug"
        base = matrix(d, "base", {"clean.0.json": clean, "draft_bug.0.json": mutant})

        strict_clean = copy.deepcopy(clean)
        strict_clean["tolerance"]["max_lse_abs"] = 1e-4
        caught = copy.deepcopy(mutant)
        caught["tolerance"]["max_lse_abs"] = 1e-4
        c = caught["classes"][1]
        c["breaches"], c["breach_fraction"], c["first_breach_call"] = 1, 0.5, 1
        c["criteria"] = {"lse": 1}
        c["first_reason"] = "lse max_abs 0.0005 > 0.0001"
        new = matrix(d, "new", {"clean.0.json": strict_clean, "draft_bug.0.json": caught})

        out = os.path.join(d, "out")
        p = subprocess.run([sys.executable, os.path.join(HERE, "limit_comparison.py"), base, new,
                            "--out", out, "--name", "cmp"], capture_output=True, text=True)
        assert p.returncode == 0, f"limit_comparison.py failed:\n{p.stdout}{p.stderr}"
        with open(os.path.join(out, "cmp.json")) as f:
            r = json.load(f)
        with open(os.path.join(out, "cmp.md")) as f:
            md = f.read()
        assert r["change"] == "max_lse_abs 0.01 -> 0.0001", r["change"]
        assert r["clean"]["breaches_base"] == 0 and r["clean"]["breaches_new"] == 0, r["clean"]
        assert [(n["mutant"], n["prefix"]) for n in r["newly_caught_classes"]] == \
            [("draft_bug", 130)], r["newly_caught_classes"]
        marked = [g for g in r["groups"] if g["breaches_new"] > g["breaches_base"]]
        assert [(g["mutant"], g["prefix"]) for g in marked] == [("draft_bug", 130)], marked
        assert "| draft_bug | random | 130 | 1 | 2 | 0.00 | 0.50 **+** |" in md, md
        assert "[`base.md`](base.md), [`new.md`](new.md)" in md, md

        # A matrix with a mutant more (a full matrix against a subset): the common ones compared,
        # the other named.
        extra = copy.deepcopy(caught)
        extra["label"] = "other_bug"
        wider = matrix(d, "wider", {"clean.0.json": strict_clean, "draft_bug.0.json": caught,
                                    "other_bug.0.json": extra})
        p = subprocess.run([sys.executable, os.path.join(HERE, "limit_comparison.py"), base, wider,
                            "--out", out, "--name", "wide"], capture_output=True, text=True)
        assert p.returncode == 0, f"limit_comparison.py failed:\n{p.stdout}{p.stderr}"
        with open(os.path.join(out, "wide.json")) as f:
            w = json.load(f)
        assert w["mutants_in_one_matrix_only"] == {"base": [], "new": ["other_bug"]}, w
        assert {g["mutant"] for g in w["groups"]} == {"clean", "draft_bug"}, w["groups"]
        with open(os.path.join(out, "wide.md")) as f:
            assert "second tolerance only, not compared: `other_bug`." in f.read()

        # Matrices of different calls are not the same calls judged twice: refused.
        fewer = copy.deepcopy(caught)
        fewer["classes"] = fewer["classes"][:1]
        other = matrix(d, "other", {"clean.0.json": strict_clean, "draft_bug.0.json": fewer})
        p = subprocess.run([sys.executable, os.path.join(HERE, "limit_comparison.py"), base, other,
                            "--out", out, "--name", "bad"], capture_output=True, text=True)
        assert p.returncode != 0 and "not the same calls" in p.stderr, p.stderr
    print("limit_comparison: ok")


if __name__ == "__main__":
    main()
