"""The `dspark` command line: generate and profile, in-process."""

from __future__ import annotations

import json

from dspark.cli import main
from dspark.spec.cost_model import CostModel
from dspark.testing.drafters import make_tiny_drafter


def test_generate_prints_json_lines(tiny_qwen, capsys):
    rc = main(["generate", "--model", tiny_qwen, "--device", "cpu", "--prompt", "def add(a, b):",
               "--prompt", "x = 1", "--max-tokens", "6", "--ignore-eos"])  # fmt: skip
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["prompt"] for x in lines] == ["def add(a, b):", "x = 1"]
    assert all(len(x["token_ids"]) == 6 and x["finish_reason"] == "length" for x in lines)


def test_generate_bad_config_is_a_clear_error(tiny_qwen, capsys):
    rc = main(["generate", "--model", tiny_qwen, "--device", "cpu", "--prompt", "a",
               "--speculative-config", '{"model": "x", "bogus": 1}'])  # fmt: skip
    assert rc == 2 and "bogus" in capsys.readouterr().err


def test_a_model_folder_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    for cmd in (["generate", "--prompt", "a"], ["profile", "--output", str(tmp_path / "c.json")]):
        rc = main([*cmd, "--model", str(tmp_path / "none"), "--device", "cpu"])
        err = capsys.readouterr().err
        assert rc == 2 and f"no config.json in model folder '{tmp_path / 'none'}'" in err, err
        assert "Traceback" not in err


def test_profile_writes_a_table_with_provenance(tiny_qwen, tmp_path, capsys):
    drafter = make_tiny_drafter(str(tmp_path / "d"), tiny_qwen)
    out = tmp_path / "cost.json"
    spec = json.dumps({"model": drafter, "num_speculative_tokens": 3})
    rc = main(["profile", "--model", tiny_qwen, "--device", "cpu", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "64", "--speculative-config", spec,
               "--repeats", "2", "--warmup", "1", "--context-len", "16", "--output", str(out)])
    assert rc == 0
    cost = CostModel.from_json(out)
    assert cost.provenance["model"] == tiny_qwen and cost.provenance["num_speculative_tokens"] == 3
    assert cost.provenance["device_name"].startswith("cpu") and cost.provenance["torch"]
    assert list(cost.verify_tokens)[0] == 1 and max(cost.verify_tokens) == 32
    assert (cost.verify_ms > 0).all() and len(cost.draft_reqs) > 0
    assert "verify" in capsys.readouterr().out
