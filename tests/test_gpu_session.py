"""The GPU test session's set-up (conftest.py): fla's recorded autotuning restored into Triton's cache."""

import importlib.util
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_root_conftest():
    spec = importlib.util.spec_from_file_location("k3lab_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fla_autotuning_restored_once_and_only_autotune_files(tmp_path):
    hooks = load_root_conftest()
    assert {p.name for p in hooks.FLA_AUTOTUNE_CACHES} == {"fla060-triton36-h200-autotune.tgz",
                                                           "fla060-triton36-h200-model-autotune.tgz"}
    expected = set()
    for archive in hooks.FLA_AUTOTUNE_CACHES:
        with tarfile.open(archive) as tar:
            expected |= {Path(m.name).as_posix().lstrip("./") for m in tar.getmembers()
                         if m.isfile() and m.name.endswith(".autotune.json")}
    written = hooks.restore_fla_autotuning(tmp_path)
    got = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert written == len(got) == len(expected) > 0 and got == expected
    assert hooks.restore_fla_autotuning(tmp_path) == 0  # a second run writes nothing (existing entries kept)
