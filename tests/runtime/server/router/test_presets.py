"""The router's catalogue as llama-server builds it: a models directory (files named by
their stem, subdirectories by their name, the first shard of a split model, projectors left
out), an INI preset (``[*]`` for every model, router keys read off, a name in both merged)
and the one-line errors of a bad one; then a preset's keys as ``serve``'s flags."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.commands.serve_router import option_argv, serve_parser
from runtime.errors import UserError
from runtime.server.router.presets import catalogue


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_a_models_directory_as_llama_server_lists_it(tmp_path):
    _touch(tmp_path / "small.gguf")
    _touch(tmp_path / "notes.txt")
    split = tmp_path / "big"
    _touch(split / "big-00002-of-00002.gguf")
    first = _touch(split / "big-00001-of-00002.gguf")
    vision = tmp_path / "seeing"
    model = _touch(vision / "seeing-Q4.gguf")
    projector = _touch(vision / "mmproj-seeing.gguf")   # its projector (llama-server's rule)
    _touch(tmp_path / "empty" / "README")
    specs = {s.name: s for s in catalogue(str(tmp_path), None)}
    assert sorted(specs) == ["big", "seeing", "small"]
    assert specs["big"].options == (("model", str(first)),)
    assert specs["seeing"].options == (("model", str(model)), ("mmproj", str(projector)))
    assert specs["small"].source == "models_dir" and not specs["small"].load_on_startup


def test_a_preset_file_with_its_global_section_and_router_keys(tmp_path):
    _touch(tmp_path / "dir" / "small.gguf")
    preset = tmp_path / "models.ini"
    preset.write_text("; comment\n[*]\nctx-size = 4096\n\n"
                      "[qwen]\nmodel = /m/qwen.gguf\ndevices.cpu = 8GiB\nalias = q, qwen3\n"
                      "tags = moe\nload-on-startup = true\nstop-timeout = 3\nversion = 1\n\n"
                      "[small]\nctx-size = 1024\n")
    specs = {s.name: s for s in catalogue(str(tmp_path / "dir"), str(preset))}
    qwen = specs["qwen"]
    assert qwen.options == (("ctx-size", "4096"), ("model", "/m/qwen.gguf"),
                            ("devices.cpu", "8GiB"))     # ':' in a key is no delimiter
    assert qwen.aliases == ("q", "qwen3") and qwen.tags == ("moe",)
    assert qwen.load_on_startup and qwen.stop_timeout_s == 3.0 and qwen.source == "preset"
    # in both: the directory's file, then the preset's keys (later ones win)
    assert specs["small"].options == (("ctx-size", "4096"), ("model",
                                      str(tmp_path / "dir" / "small.gguf")),
                                      ("ctx-size", "1024"))
    assert specs["small"].source == "preset"
    assert "[qwen]\nctx-size = 4096\nmodel = /m/qwen.gguf" in qwen.to_ini()


@pytest.mark.parametrize("text, said", [
    ("model = x\n", "not a valid INI file"),
    ("[a]\nmodel = x\n[a]\nmodel = y\n", "not a valid INI file"),
    ("[a]\nstop-timeout = soon\n", "stop-timeout: 'soon' is not a number"),
    ("[a]\nload-on-startup = maybe\n", "'maybe' is not true or false"),
    ("[a]\nalias = b\n[b]\nmodel = y\n", "the name 'b' is already model 'a''s"),
])
def test_a_bad_preset_is_one_line_naming_it(tmp_path, text, said):
    preset = tmp_path / "p.ini"
    preset.write_text(text)
    with pytest.raises(UserError, match=said.replace("(", r"\(")) as err:
        catalogue(None, str(preset))
    assert str(preset) in str(err.value) and "\n" not in str(err.value)


def test_a_missing_directory_or_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist or is not a directory"):
        catalogue(str(tmp_path / "nope"), None)
    with pytest.raises(UserError, match="cannot read"):
        catalogue(None, str(tmp_path / "nope.ini"))


def test_preset_keys_become_serve_flags():
    parser = serve_parser()
    assert option_argv(parser, "ctx-size", "512", "p") == ["--ctx-size", "512"]
    assert option_argv(parser, "c", "512", "p") == ["-c", "512"]
    assert option_argv(parser, "devices.cpu", "1GiB", "p") == ["--devices.cpu", "1GiB"]
    assert option_argv(parser, "mmap", "false", "p") == ["--no-mmap"]      # the opposite
    assert option_argv(parser, "no-mmap", "true", "p") == ["--no-mmap"]
    assert option_argv(parser, "embedding", "true", "p") == ["--embedding"]
    assert option_argv(parser, "embedding", "false", "p") == []
    for key, said in [("modle", "not recognized"), ("port", "not a per-model option"),
                      ("api-key", "not a per-model option"),
                      ("write-profile", "not available in router mode")]:
        with pytest.raises(UserError, match=said):
            option_argv(parser, key, "x", "p")
