"""What the GPU check needs on a device that reaches no package index, and how it gets there.

The lent GPU machine has a Python with its own packages (scripts/device_packages.txt) and receives the
repository plus at most 64 MiB of carried files. This tool, standard library only:
* `missing`:  the distributions of the check this Python lacks (setup's test on the device);
* `needed`:   the distributions the device check imports (the project's dependencies and the test
              runner, with everything they require, from the installed metadata) that the device lacks;
* `pack`:     builds a wheel of each of those from this machine's installed copy (no download, the very
              versions tested here) into a wheelhouse, and prints the carry list and its size;
* `install`:  on the device, unpacks the wheelhouse's wheels that its Python lacks into a folder that
              goes first on PYTHONPATH (no pip, no index);
* `simulate`: a stand-in for the device Python on this machine (a venv without pip whose site folder
              links only the device's packages that are installed here), for the dry run.
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata as metadata
import io
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_PACKAGES = ROOT / "scripts" / "device_packages.txt"
WHEELHOUSE = ROOT / ".whl"  # ignored by git (.git/info/exclude); named in the device call's carry
CARRY_LIMIT = 64 << 20  # the working tree plus carried paths that travel to the device
RUNNER = ("pytest", "hypothesis", "pytest-xdist")  # the device check runs `pytest -m gpu`
# Required by a dependency's metadata but never imported by the check, with why.
NOT_IMPORTED = {"anywidget": "egglog's notebook visualizer, imported only to show an e-graph widget"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages(path: Path = DEVICE_PACKAGES) -> frozenset[str]:
    lines = path.read_text().splitlines()
    return frozenset(canonical(line.strip()) for line in lines if line.strip() and not line.startswith("#"))


def _requirement_names(requires: list[str]) -> list[str]:
    """Names of the unconditional requirements (no extra; markers evaluated for this Python)."""
    from packaging.requirements import Requirement
    names = []
    for text in requires:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(canonical(req.name))
    return names


def roots() -> list[str]:
    """The project's dependencies (pyproject.toml) plus the test runner."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return _requirement_names(project["dependencies"]) + list(RUNNER)


def walk(device: frozenset[str]) -> dict[str, bool]:
    """Every distribution the check imports, whether this Python has it: the roots, and what the ones the
    device lacks require in turn (a device package's own requirements are the device image's business)."""
    seen: dict[str, bool] = {}
    todo = roots()
    while todo:
        name = todo.pop(0)
        if name in seen or name in NOT_IMPORTED:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            seen[name] = False
            continue
        seen[name] = True
        if name not in device:
            todo += _requirement_names(dist.requires or [])
    return seen


def needed(device: frozenset[str]) -> list[str]:
    """The check's distributions that the device lacks: the wheels to carry (each must be installed here)."""
    walked = walk(device)
    absent = [name for name, present in walked.items() if not present and name not in device]
    if absent:
        raise SystemExit(f"not installed here, so not packed: {' '.join(absent)}")
    return [name for name in walked if name not in device]


def missing(device: frozenset[str]) -> list[str]:
    """The check's distributions this Python lacks (setup's test on the device, after unpacking)."""
    return [name for name, present in walk(device).items() if not present]


# -- packing: a wheel from an installed distribution ----------------------------------------------------

def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pack_wheel(name: str, dest: Path) -> Path:
    """A wheel of the installed distribution `name`: its files under site-packages (no scripts, no
    bytecode) with a fresh RECORD; the tag is the one its WHEEL file names."""
    dist = metadata.distribution(name)
    site = Path(dist.locate_file(""))
    files = [f for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in f.parts]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    tag = re.search(r"^Tag: (\S+)", (site / info / "WHEEL").read_text(), re.M).group(1)
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}-{tag}"
    path = dest / f"{stem}.whl"
    rows = []
    dest.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as wheel:
        for file in files:
            if file.parts[0] == info and file.name in ("RECORD", "INSTALLER", "direct_url.json", "REQUESTED"):
                continue
            data = (site / file).read_bytes()
            wheel.writestr(str(file), data)
            rows.append((str(file), _record_hash(data), str(len(data))))
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(rows + [(f"{info}/RECORD", "", "")])
        wheel.writestr(f"{info}/RECORD", record.getvalue())
    tmp.replace(path)
    return path


# -- installing on the device: unpack, no pip ----------------------------------------------------------

def wheel_name(path: Path) -> str:
    return canonical(path.name.split("-")[0])


def install(wheelhouse: Path, target: Path) -> list[str]:
    """Unpack every wheel whose distribution this Python lacks into `target` (a folder for PYTHONPATH);
    returns the names installed. A wheel's .data/purelib|platlib go to `target` too; its scripts do not."""
    done = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        name = wheel_name(wheel)
        try:
            metadata.distribution(name)
            continue
        except metadata.PackageNotFoundError:
            pass
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                parts = member.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                out = target.joinpath(*parts)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(archive.read(member))
        done.append(name)
    return done


# -- the carry: what travels to the device -------------------------------------------------------------

def tree_bytes() -> int:
    """Bytes of the working tree that travels (tracked and untracked files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.split(b"\0")
    return sum((ROOT / os.fsdecode(p)).stat().st_size for p in listed if p and (ROOT / os.fsdecode(p)).is_file())


def carry_report(wheelhouse: Path) -> tuple[list[str], bool]:
    """Lines naming the carry list and its size against the limit; and whether it fits."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()
    total = tree + wheel_bytes
    rel = os.path.relpath(wheelhouse, ROOT)
    lines = [f"carry: [\"{rel}\"] ({len(wheels)} wheels, {wheel_bytes / 2**20:.1f} MiB: "
             + ", ".join(f"{w.name.split('-')[0]} {w.stat().st_size / 2**20:.1f}" for w in wheels) + ")",
             f"carry: working tree {tree / 2**20:.1f} MiB + carried {wheel_bytes / 2**20:.1f} MiB = "
             f"{total / 2**20:.1f} MiB of {CARRY_LIMIT >> 20} MiB"]
    return lines, total <= CARRY_LIMIT


# -- the stand-in device Python ------------------------------------------------------------------------

def simulate(folder: Path, device: frozenset[str]) -> Path:
    """A venv (no pip of its own) whose site-packages links the top-level entries of every device package
    installed in this Python (a CUDA 12 wheel standing for the device's CUDA 13 one): the device's Python,
    less what this machine lacks (CuPy). Returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", "--clear", str(folder)], check=True)
    site = next(folder.glob("lib/python*/site-packages"))
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name not in device and name.removesuffix("-cu12") not in device:  # CUDA 12's wheel for the device's 13
            continue
        for top in {f.parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source, link = Path(dist.locate_file(top)), site / top
            if source.exists() and not link.exists() and top != "__pycache__":
                link.symlink_to(source)
    return folder / "bin" / "python"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("needed")
    sub.add_parser("missing")
    pack = sub.add_parser("pack")
    pack.add_argument("--dest", type=Path, default=WHEELHOUSE)
    inst = sub.add_parser("install")
    inst.add_argument("wheelhouse", type=Path)
    inst.add_argument("target", type=Path)
    sim = sub.add_parser("simulate")
    sim.add_argument("folder", type=Path)
    report = sub.add_parser("report")
    report.add_argument("--dest", type=Path, default=WHEELHOUSE)
    args = parser.parse_args(argv)
    if args.command == "needed":
        print(" ".join(needed(device_packages())))
    elif args.command == "missing":
        lacking = missing(device_packages())
        print(f"missing: {' '.join(lacking)}" if lacking else "missing: nothing")
        return 1 if lacking else 0
    elif args.command == "pack":
        names = needed(device_packages())
        for old in args.dest.glob("*.whl"):
            if wheel_name(old) not in names:
                old.unlink()
        for name in names:
            print(f"packed {pack_wheel(name, args.dest).name}")
        lines, fits = carry_report(args.dest)
        print("\n".join(lines))
        return 0 if fits else 1
    elif args.command == "install":
        names = install(args.wheelhouse, args.target)
        print(f"installed from {args.wheelhouse}: {' '.join(names) or 'nothing (all present)'}")
    elif args.command == "simulate":
        print(simulate(args.folder, device_packages()))
    elif args.command == "report":
        lines, fits = carry_report(args.dest)
        print("\n".join(lines))
        return 0 if fits else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
