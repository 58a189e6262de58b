"""Config loading: frozen dataclasses, and errors that name the file, the key and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from hmp.job import loads
from hmp.errors import ConfigError
from tests.support import GOOD_CONFIG

ROOT = Path(__file__).resolve().parents[2]


PIPELINE = (ROOT / "conf/click_pipeline.toml").read_text()


def test_a_read_only_report_folder_is_a_config_error_for_root_too(tmp_path):
    """Permission bits do not stop root; a read-only file system does, and the check sees it."""
    import os
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        with pytest.raises(ConfigError) as info:
            loads(f'[job]\nreport_dir = "{ro / "run"}"\n' + GOOD_CONFIG)
        assert info.value.key == "job.report_dir" and f"{ro} is not writable" in info.value.expected
    finally:
        subprocess.run(["umount", str(ro)], check=True)
