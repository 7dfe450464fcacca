"""scripts/install_missing.py: what a python lacks of requirements.txt, installed from a folder of wheels with no
index and no internet (the wheelhouse `make wheelhouse` builds), and one line when a wheel is not there."""
import subprocess
import sys
import zipfile

from conftest import REPO


def _wheel(folder, name: str, version: str):
    """A pure-python wheel of an empty package: what pip needs of one, and nothing else."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def _install(wheels, *args):
    return subprocess.run([sys.executable, "scripts/install_missing.py", wheels, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_missing_pin_is_installed_from_the_wheels_and_a_missing_wheel_is_one_line(tmp_path):
    pin = next(line.split("==")[1] for line in (REPO / "requirements.txt").read_text().splitlines()
               if line.startswith("tqdm=="))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "tqdm", pin)
    done = _install(wheels, "--target", tmp_path / "site", "--missing", "tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"tqdm {pin}: installed from the wheelhouse" in done.stdout
    assert "torch" not in done.stdout.split()  # the machine's own, left alone
    assert (tmp_path / "site" / f"tqdm-{pin}.dist-info").is_dir()
    failed = _install(wheels, "--target", tmp_path / "site", "--missing", "psutil")
    assert failed.returncode == 1 and failed.stderr.count("\n") == 1, failed.stderr
    assert "has no wheel of psutil" in failed.stderr and "add it and rerun" in failed.stderr
