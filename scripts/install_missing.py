#!/usr/bin/env python3
"""Install from a wheelhouse (scripts/wheelhouse.sh) the pins of requirements.txt that this Python lacks.

    python3 scripts/install_missing.py DIR [--target T] [--missing NAME ...]

Run on the target machine, offline, with the python3 that will train. torch and torchvision are left alone
(the machine's own CUDA build, whatever its version). Every other pin that no distribution of that name
satisfies here is installed from DIR, with the dependencies pip finds missing or too old; pins that are
installed in another version are kept and reported. --target T installs into T (then run with PYTHONPATH=T)
and counts what T already holds as installed. --missing NAME treats NAME as absent (to try it out).
pip reads no configuration here, so DIR is the only source. Stdlib only; needs pip >= 22.2.
"""
import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LEFT_ALONE = {"torch", "torchvision"}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name, paths):
    dist = next(importlib.metadata.distributions(name=name, path=paths), None)
    return dist.version if dist else None


def pip(args, target):
    # DIR is the only source: no pip configuration files (PIP_CONFIG_FILE=/dev/null) nor PIP_* variables (--isolated)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    if target:  # pip then sees what T holds as installed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [target, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def fail(line):
    print(f"install_missing: {line}", file=sys.stderr)
    sys.exit(1)


def no_wheel(said: str, wheelhouse):
    """One line, and exit 1, when pip said a distribution has no wheel in the wheelhouse."""
    missing = re.search(r"No matching distribution found for (\S+)", said)
    if missing and norm(re.split(r"[<>=!~;\[ ]", missing[1])[0]) in LEFT_ALONE:
        fail(f"this Python has no {missing[1]}, which the wheelhouse leaves out: install the machine's CUDA build of "
             f"it first")
    if missing:
        fail(f"{wheelhouse} has no wheel of {missing[1]} for Python {sys.version_info[0]}.{sys.version_info[1]} "
             f"(needed here); add it and rerun")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheelhouse")
    ap.add_argument("--target", help="install into this directory instead of the current environment")
    ap.add_argument("--requirements", default=Path(__file__).resolve().parent.parent / "requirements.txt")
    ap.add_argument("--missing", nargs="*", default=[], metavar="NAME", help="treat these as not installed")
    a = ap.parse_args()
    if not Path(a.wheelhouse).is_dir():
        fail(f"no wheelhouse directory {a.wheelhouse}")
    target = str(Path(a.target).resolve()) if a.target else None
    paths = ([target] if target else []) + sys.path
    treat_missing = {norm(n) for n in a.missing}

    pins, wanted = {}, []
    for line in Path(a.requirements).read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if not m or norm(m[1]) in LEFT_ALONE:
            continue
        name, pin = m[1], m[2]
        have = None if norm(name) in treat_missing else installed_version(name, paths)
        pins[norm(name)] = (name, pin, have)
        if have is None:
            wanted.append(f"{name}=={pin}")

    install, before = {}, {}
    if wanted:
        # Which distributions must come from DIR: the wanted pins and their dependencies that nothing here
        # satisfies. pip resolves against this environment (and T), so an older torch is fine where allowed.
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp, "report.json")
            common = ["--no-index", "--find-links", a.wheelhouse]
            r = pip(["install", "--dry-run", "--quiet", "--report", str(report), *common, *wanted], target)
            if r.returncode != 0:
                no_wheel(r.stdout, a.wheelhouse)
                fail(f"pip could not resolve {' '.join(wanted)}:\n{r.stdout.strip()}")
            for item in json.loads(report.read_text())["install"]:
                install[norm(item["metadata"]["name"])] = (item["metadata"]["name"], item["metadata"]["version"])
        for pin in wanted:  # --missing names that pip finds satisfied are reinstalled anyway
            name, version = pin.split("==")
            install.setdefault(norm(name), (name, version))
        before = {key: installed_version(name, paths) for key, (name, _) in install.items()}
        where = ["--target", target, "--upgrade"] if target else []
        specs = [f"{name}=={version}" for name, version in install.values()]
        r = pip(["install", "--quiet", "--no-deps", *common, *where, *specs], target)
        if r.returncode != 0:
            no_wheel(r.stdout, a.wheelhouse)
            fail(f"pip install failed:\n{r.stdout.strip()}")

    def replaced(key):  # what this Python had of a distribution now installed from DIR
        return f", in place of {before[key]}" if before[key] and key not in treat_missing else ""

    for key, (name, pin, have) in pins.items():
        if key in install:
            print(f"{name} {install[key][1]}: installed from the wheelhouse{replaced(key)}")
        else:
            print(f"{name} {have}: already there" + (f" (differs from the pin {pin})" if have != pin else ""))
    for key, (name, version) in install.items():
        if key not in pins:
            print(f"{name} {version}: installed from the wheelhouse (a dependency{replaced(key)})")


if __name__ == "__main__":
    main()
