"""Building the policy folder (``model.build``) never writes into a user's folder, and is whole or absent."""

import json
import os

import pytest
from omegaconf import OmegaConf

from clawray import build, model_folders


def _cfg(path, kind="smollm2"):
    return OmegaConf.create({"model": {"path": str(path), "build": kind}})


def test_a_build_fills_only_a_new_folder_whole_and_never_a_users_folder(tmp_path, monkeypatch):
    """``model.path`` pointing at a half-downloaded model (files, no config.json) had SmolLM2 written
    over it (weights, tokenizer, config) and the run trained SmolLM2 under the user's model name. A
    build now goes only into a new (or empty) folder, through a sibling renamed into place."""
    built = []

    def fake(out):
        os.makedirs(out, exist_ok=True)
        built.append(os.path.basename(out))
        if "fail" in out:
            raise RuntimeError("download failed")
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"model_type": "llama"}, f)
        return out

    monkeypatch.setattr(model_folders, "BUILDERS", {"smollm2": fake})
    users = tmp_path / "Qwen2.5-7B-Instruct"
    users.mkdir()
    (users / "model-00001-of-00004.safetensors").write_bytes(b"weights")
    with pytest.raises(FileExistsError, match="not an HF folder"):
        build.ensure_model(_cfg(users))
    assert os.listdir(users) == ["model-00001-of-00004.safetensors"] and built == []
    new = tmp_path / "smol"
    assert build.ensure_model(_cfg(new)) == str(new)
    assert os.listdir(new) == ["config.json"] and built == [f"smol.building-{os.getpid()}"]
    assert sorted(os.listdir(tmp_path)) == ["Qwen2.5-7B-Instruct", "smol"]  # no partial folder left
    assert build.ensure_model(_cfg(new)) == str(new) and len(built) == 1  # built once
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build.ensure_model(_cfg(empty)) == str(empty) and os.listdir(empty) == ["config.json"]
    with pytest.raises(RuntimeError, match="download failed"):
        build.ensure_model(_cfg(tmp_path / "fail"))
    assert sorted(os.listdir(tmp_path)) == ["Qwen2.5-7B-Instruct", "empty", "smol"]  # nothing half-built
    with pytest.raises(FileNotFoundError, match="model.build is none"):
        build.ensure_model(_cfg(tmp_path / "missing", "none"))


def test_clawray_model_refuses_a_folder_that_holds_files_and_builds_a_new_one_whole(tmp_path, monkeypatch, capsys):
    """``clawray model tiny DIR`` on the user's model folder replaced its config and tokenizer and
    deleted a weight shard, then exited 0. It now builds only a new (or empty) folder, as
    ``model.build`` does (one function, :func:`clawray.model_folders.build_model_folder`)."""
    from clawray.cli import main

    def fake(out):
        os.makedirs(out)
        (open(os.path.join(out, "config.json"), "w")).close()
        return out

    monkeypatch.setattr(model_folders, "BUILDERS", {"tiny": fake})
    users = tmp_path / "m"
    users.mkdir()
    (users / "config.json").write_text('{"note": "my 4B"}')
    (users / "model-00001-of-00002.safetensors").write_bytes(b"s")
    assert main(["model", "tiny", str(users)]) == 1
    assert "is a folder that is not empty" in capsys.readouterr().err
    assert sorted(os.listdir(users)) == ["config.json", "model-00001-of-00002.safetensors"]
    assert (users / "config.json").read_text() == '{"note": "my 4B"}'
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert main(["model", "tiny", str(a_file)]) == 1 and a_file.read_text() == "x"
    assert main(["model", "tiny", str(tmp_path / "new") + "/"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "new")
    assert os.listdir(tmp_path / "new") == ["config.json"] and sorted(os.listdir(tmp_path)) == ["f", "m", "new"]
