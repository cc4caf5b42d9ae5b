"""The upstreamable verl patches in patches/: each applies cleanly to the installed verl 0.9.1 and compiles."""

from __future__ import annotations





# ---------------------------------------------------------------------------------------------- patches


def test_each_patch_applies_cleanly_to_the_installed_verl():
    from verl_prm.integrations.verl.patches import check_patches, find_patches, installed_verl_root

    statuses = check_patches()
    assert [s.patch.name for s in statuses] == [p.name for p in find_patches()]
    assert len(statuses) == 7  # 0001-0003: the plugin's workarounds; 0004-0007: the CPU platform's fixes
    assert all(s.state == "applies" for s in statuses), [(s.patch.name, s.state, s.detail) for s in statuses]
    assert (installed_verl_root() / "verl" / "__init__.py").is_file()


def test_patches_apply_to_a_copy_and_compile(tmp_path):
    import py_compile
    import re
    import shutil

    from verl_prm.integrations.verl.patches import apply_patches, check_patches, find_patches, installed_verl_root

    root = installed_verl_root()
    touched = sorted({m for p in find_patches() for m in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M)})
    for relative in touched:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / relative, tmp_path / relative)
    assert all(s.state == "applied now" for s in apply_patches(tmp_path))
    assert all(s.state == "applied" for s in check_patches(tmp_path))
    for relative in touched:
        py_compile.compile(str(tmp_path / relative), doraise=True)
    # 0007: the patched bootstrap_metric gives verl's own numbers (the installed, unpatched module is the reference)
    import importlib.util

    import numpy as np
    from verl.trainer.ppo.metric_utils import bootstrap_metric, calc_maj_val

    spec = importlib.util.spec_from_file_location("patched_metric_utils", tmp_path / "verl/trainer/ppo/metric_utils.py")
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    data = np.random.default_rng(3).integers(0, 5, 7).tolist()
    assert (patched.bootstrap_metric(data, 4, [patched.np.max, patched.np.min], seed=5)
            == bootstrap_metric(data, 4, [np.max, np.min], seed=5))
    from functools import partial

    votes = [{"val": v, "pred": str(v % 2)} for v in data]
    maj = [partial(calc_maj_val, vote_key="pred", val_key="val")]
    assert patched.bootstrap_metric(votes, 2, maj) == bootstrap_metric(votes, 2, maj)
    trainer_base = (tmp_path / "verl/trainer/ppo/v1/trainer_base.py").read_text()
    assert 'trainer_mode == "sync"' not in trainer_base and 'trainer_mode != "sync"' not in trainer_base
    # the installed verl is untouched
    assert all(s.state == "applies" for s in check_patches())


def test_patches_cli_check_exit_code(capsys):
    from verl_prm.apps.cli import main
    from verl_prm.integrations.verl.patches import find_patches

    assert main(["patches", "check"]) == 0
    assert capsys.readouterr().out.count("applies") == len(find_patches())
