"""The upstreamable verl patches in patches/: each applies cleanly to the installed verl 0.9.1 and compiles."""

from __future__ import annotations





# ---------------------------------------------------------------------------------------------- patches


def test_each_patch_applies_cleanly_to_the_installed_verl():
    from verl_prm.integrations.verl.patches import check_patches, find_patches, installed_verl_root

    statuses = check_patches()
    assert [s.patch.name for s in statuses] == [p.name for p in find_patches()]
    assert len(statuses) == 6  # 0001-0003: the plugin's workarounds; 0004-0006: the CPU platform's fixes
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
    trainer_base = (tmp_path / "verl/trainer/ppo/v1/trainer_base.py").read_text()
    assert 'trainer_mode == "sync"' not in trainer_base and 'trainer_mode != "sync"' not in trainer_base
    # the installed verl is untouched
    assert all(s.state == "applies" for s in check_patches())


def test_patches_cli_check_exit_code(capsys):
    from verl_prm.apps.cli import main
    from verl_prm.integrations.verl.patches import find_patches

    assert main(["patches", "check"]) == 0
    assert capsys.readouterr().out.count("applies") == len(find_patches())
