"""llama.cpp's flags with llama.cpp's meaning, as real ``moe-offload`` subprocesses on a
synthetic model: no abbreviations (``-cmoe`` is not ``-c moe``, ``-sys`` not ``-s ys``), the
static placement flags (``-ot``, ``--n-cpu-moe``, ``--cpu-moe``) and load flags give the same
text as a plain run, a llama.cpp flag we do not take is one line naming our equivalent, and
``-hf`` downloads through huggingface_hub from a hub stand-in on 127.0.0.1 (HF_ENDPOINT)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams
from tests.runtime.engine.conftest import REPO_ROOT
from tests.runtime.engine.fake_hub import FakeHub

COMMON = ["-c", "256", "-t", "1", "--temp", "0", "-n", "8"]


def _one_line_error(proc, *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def plain_text(tiny_model, prompt, cli) -> str:
    proc = cli("complete", "-m", str(tiny_model), "-p", prompt, *COMMON)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("flags", [
    ["-cmoe"], ["--cpu-moe"], ["-ncmoe", "2"], ["--n-cpu-moe", "2", "--no-residency"],
    ["--cpu-moe", "--no-residency"], ["-ot", r"exps=CPU"],
    ["-ot", r"blk\.0\.attn_q=CPU,token_embd=CPU", "--no-residency"],
    ["--no-mmap", "--mlock", "--no-repack"], ["--no-mmap", "--no-residency"],
])
def test_placement_and_load_flags_keep_the_text(tiny_model, prompt, cli, plain_text, flags):
    proc = cli("complete", "-m", str(tiny_model), "-p", prompt, *COMMON, *flags)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain_text          # every weight is on the CPU either way


def test_no_abbreviations(tiny_model, prompt, cli):
    _one_line_error(cli("complete", "-m", str(tiny_model), "-p", prompt, "--ctx", "64"),
                    "unrecognized arguments: --ctx")
    _one_line_error(cli("serve", "-m", str(tiny_model), "--por", "0"),
                    "unrecognized arguments: --por")
    # nor a value glued to a short flag: -sys is not -s ys anywhere, -c512 not -c 512; a
    # flag of another subcommand is named as that command's
    _one_line_error(cli("serve", "-m", str(tiny_model), "-sys", "hi"),
                    "-sys is a flag of moe-offload complete and chat", "not of serve")
    _one_line_error(cli("complete", "-m", str(tiny_model), "-np", "2"),
                    "-np is a flag of moe-offload serve", "not of complete")
    _one_line_error(cli("complete", "-m", str(tiny_model), "--parallel=2"),
                    "--parallel is a flag of moe-offload serve")
    _one_line_error(cli("serve", "-m", str(tiny_model), "-sx"),
                    "unrecognized argument -sx", "not -s 'x'")
    _one_line_error(cli("complete", "-m", str(tiny_model), "-p", prompt, "-c512"),
                    "unrecognized argument -c512")
    ok = cli("complete", "-m", str(tiny_model), "-p", prompt, "-c", "256", "-n", "-1", "-s",
             "-1", "-t", "1", "-ngl", "-1")                 # negative values still pass
    assert ok.returncode == 0, ok.stderr


def test_system_prompt_is_the_chat_template(tiny_model, prompt, cli, make_settings):
    proc = cli("complete", "-m", str(tiny_model), "-p", prompt, "-sys", "Be brief", *COMMON)
    assert proc.returncode == 0, proc.stderr
    with Engine(make_settings(tiny_model, n_ctx=256, manage_residency=False),
                progress=False) as engine:
        text = engine.chat_prompt([{"role": "system", "content": "Be brief"},
                                   {"role": "user", "content": prompt}])
        want = "".join(c.text for c in engine.generate(
            text, SamplingParams(max_tokens=8, temperature=0)))
    assert proc.stdout == want + "\n"
    chat = cli("chat", "-m", str(tiny_model), "-sys", "Be brief", *COMMON, stdin="hi\n")
    assert chat.returncode == 0, chat.stderr


@pytest.mark.parametrize("flag, says", [
    (["-ctk", "q8_0"], "the KV cache is f16 here"),
    (["--cache-type-v=q8_0"], "the KV cache is f16 here"),
    (["-ts", "3,1"], "--devices.cuda:0"),
    (["-fit", "on"], "--auto"),
    (["-md", "draft.gguf"], "speculative decoding"),
    (["-cnv"], "moe-offload chat"),
    (["--cache-reuse", "256"], "reuses a slot's KV prefix"),
    (["-mu", "https://example.com/m.gguf"], "-hf USER/MODEL[:QUANT]"),
    (["--models-dir", "models"], "no router mode"),
])
def test_untaken_llama_flag_names_the_equivalent(tiny_model, prompt, cli, flag, says):
    proc = cli("complete", "-m", str(tiny_model), "-p", prompt, *flag)
    _one_line_error(proc, f"{flag[0].split('=')[0]} is llama.cpp's flag", says)
    assert proc.returncode == 2


def test_override_tensor_refusals(tiny_model, prompt, cli):
    _one_line_error(cli("complete", "-m", str(tiny_model), "-p", prompt, "-ot", "exps=CUDA0"),
                    "routed experts", "--devices.cuda:0", "--no-residency")
    _one_line_error(cli("complete", "-m", str(tiny_model), "-p", prompt, "-ot", "exps=NOPE",
                        "--no-residency"), "unknown buffer type 'NOPE'", "CPU")
    _one_line_error(cli("complete", "-m", str(tiny_model), "-p", prompt, "-ot", "exps"),
                    "REGEX=BUFT")
    _one_line_error(cli("complete", "-m", str(tiny_model), "-p", prompt, "-ot", "(=CPU"),
                    "not a regex")
    _one_line_error(cli("complete", "-m", str(tiny_model), "-p", prompt, "-ncmoe", "-1"),
                    "--n-cpu-moe")


def test_version_and_list_devices(cli):
    for args in (["--version"], ["serve", "--version"]):
        proc = cli(*args)
        assert proc.returncode == 0
        assert proc.stdout.startswith("moe-offload ") and "llama-cpp-python 0.3." in proc.stdout
    proc = cli("complete", "--list-devices")
    assert proc.returncode == 0, proc.stderr
    # llama-server's own short and positive forms parse (--list-devices then exits)
    server = cli("serve", "-a", "x", "-kvu", "-cb", "--webui", "--no-context-shift", "--mmap",
                 "--list-devices")
    free = re.compile(r"\d+ MiB free")        # the RAM available moves between the runs
    assert server.returncode == 0, server.stderr
    assert free.sub("", server.stdout) == free.sub("", proc.stdout)
    assert proc.stdout.splitlines()[0] == "Available devices:"
    cpu = next(line for line in proc.stdout.splitlines()[1:] if line.strip().startswith("CPU"))
    total, available = map(int, re.search(r"\((\d+) MiB, (\d+) MiB free\)", cpu).groups())
    assert available < total          # the RAM available now, not ggml's total-as-free


def test_ignore_eos_generates_past_the_end_token(tiny_model, make_settings):
    with Engine(make_settings(tiny_model, manage_residency=False), progress=False) as engine:
        eos = engine.eog_tokens()[0]
        forced = {eos: 100.0}                  # the end token would win every step
        stopped = list(engine.generate("A", SamplingParams(max_tokens=6, temperature=0,
                                                           logit_bias=forced)))
        assert stopped[-1].usage.completion_tokens == 0
        on = list(engine.generate("A", SamplingParams(max_tokens=6, temperature=0,
                                                      logit_bias=forced, ignore_eos=True)))
        assert on[-1].usage.completion_tokens == 6 and on[-1].finish_reason == "length"


# -- -hf ------------------------------------------------------------------------------------

def _hf(hub_url: str, home, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_ENDPOINT=hub_url, HF_HOME=str(home))
    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                "ALL_PROXY", "all_proxy"):       # the stand-in hub is on this machine
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "runtime.cli", "complete", *args, "-p", "A",
                           *COMMON], capture_output=True, text=True, timeout=120, env=env,
                          cwd=REPO_ROOT)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_hf_downloads_into_the_hub_cache(tiny_model, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"not a model")
    repo = {"me/tiny-GGUF": {"tiny-Q4_K_M.gguf": tiny_model, "tiny-Q8_0.gguf": tiny_model,
                             "tiny-F16.gguf": other, "README.md": REPO_ROOT / "README.md"}}
    home = tmp_path / "hf"
    with FakeHub(repo) as hub:
        default = _hf(hub.url, home, "-hf", "me/tiny-GGUF")          # Q4_K_M by default
        assert default.returncode == 0, default.stderr
        assert "GET /me/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf" in hub.requests
        quant = _hf(hub.url, home, "-hf", "me/tiny-GGUF:q8_0")        # any case
        assert quant.returncode == 0, quant.stderr
        assert quant.stdout == default.stdout
        assert "HEAD /me/tiny-GGUF/resolve/main/tiny-Q8_0.gguf" in hub.requests
        file = _hf(hub.url, home, "--hf-repo", "me/tiny-GGUF", "--hf-file", "tiny-Q8_0.gguf")
        assert file.returncode == 0, file.stderr
        _one_line_error(_hf(hub.url, home, "-hf", "me/tiny-GGUF:Q2_K"),
                        "no .gguf file with Q2_K", "F16, Q4_K_M, Q8_0")
        _one_line_error(_hf(hub.url, home, "-hf", "me/tiny-GGUF", "-hff", "nope.gguf"),
                        "no file nope.gguf")
    snapshots = home / "hub" / "models--me--tiny-GGUF" / "snapshots"
    assert {p.name for p in snapshots.glob("*/*.gguf")} == {"tiny-Q4_K_M.gguf",
                                                            "tiny-Q8_0.gguf"}
    # offline: what is cached still loads; what is not is one line saying how to fetch it
    offline = _hf(_closed_port(), home, "-hf", "me/tiny-GGUF:Q8_0")
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == default.stdout
    _one_line_error(_hf(_closed_port(), home, "-hf", "me/tiny-GGUF:F16"),
                    "cannot reach", "download it by hand", "-m FILE")
    _one_line_error(_hf(_closed_port(), tmp_path / "empty", "-hf", "me/tiny-GGUF"),
                    "cannot reach", "download it by hand", "/me/tiny-GGUF")


def test_hf_needs_a_repo(cli):
    _one_line_error(cli("complete", "-p", "A"), "-m FILE", "-hf")
    _one_line_error(cli("complete", "-p", "A", "--hf-file", "x.gguf"), "--hf-file")
    _one_line_error(cli("complete", "-p", "A", "-hf", "nouser"), "USER/MODEL")


def test_cuda_budget_without_the_device_is_one_line(tiny_model, prompt, cli):
    import glob

    if glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("this machine has an NVIDIA GPU")
    for command in (["complete", "-p", prompt], ["serve", "--port", "0"]):
        proc = cli(*command, "-m", str(tiny_model), "--devices.cuda:0", "4GiB")
        _one_line_error(proc, "cuda:0: no such device", "no CUDA device")


def test_serve_ignore_eos_is_the_default_of_requests():
    from runtime.server.requests import sampling_params
    from runtime.server.schemas import CompletionRequest

    req = CompletionRequest(prompt="A")
    assert sampling_params(req, 4, defaults=SamplingParams(ignore_eos=True)).ignore_eos
    assert not sampling_params(req, 4, defaults=SamplingParams()).ignore_eos


def test_load_flags_reach_llama_cpp(tiny_model, prompt, cli):
    """--no-mmap reads the weights into a plain CPU buffer, --mlock maps and locks them:
    llama.cpp's own log (-v) says so."""
    def log(*flags):
        proc = cli("complete", "-m", str(tiny_model), "-p", prompt, *COMMON, "-v", *flags)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "CPU_Mapped model buffer" in log()
    no_mmap = log("--no-mmap")
    assert "CPU model buffer" in no_mmap and "CPU_Mapped" not in no_mmap
    assert "load_mode = mmap+mlock" in log("--mlock")


def test_static_rules_reach_llama_cpp(tiny_model, prompt, cli):
    """llama.cpp logs each tensor a rule overrides: --n-cpu-moe 1 names layer 0's experts,
    -ot names what its regex matches."""
    def overridden(*flags):
        proc = cli("complete", "-m", str(tiny_model), "-p", prompt, *COMMON, "-v",
                   "--no-residency", *flags)
        assert proc.returncode == 0, proc.stderr
        return {line.split()[1] for line in proc.stderr.splitlines()
                if line.startswith("tensor ") and "buffer type overridden to CPU" in line}

    assert overridden() == set()
    assert overridden("-ncmoe", "1") == {f"blk.0.ffn_{p}_exps.weight"
                                         for p in ("gate", "up", "down")}
    assert overridden("-cmoe") == {f"blk.{i}.ffn_{p}_exps.weight" for i in range(4)
                                   for p in ("gate", "up", "down")}
    assert overridden("-ot", r"blk\.1\.attn_q\.=CPU") == {"blk.1.attn_q.weight"}


def test_hf_fetches_every_part_of_a_split_model(tiny_model, tmp_path):
    part2 = tmp_path / "part2.gguf"
    part2.write_bytes(b"second part")
    repo = {"me/split-GGUF": {"m-Q8_0-00001-of-00002.gguf": tiny_model,
                              "m-Q8_0-00002-of-00002.gguf": part2}}
    home = tmp_path / "hf"
    with FakeHub(repo) as hub:
        proc = _hf(hub.url, home, "-hf", "me/split-GGUF:Q8_0")
        assert proc.returncode == 0, proc.stderr          # loaded from the first part
    got = {p.name for p in (home / "hub").rglob("*.gguf")}
    assert got == {"m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"}


def test_positive_forms_keep_the_defaults():
    """A positive form added beside a negative one (--webui, --mmap, --no-context-shift) does
    not change what giving neither means."""
    from runtime.cli import build_parser

    parser = build_parser()
    plain = parser.parse_args(["serve", "-m", "x.gguf"])
    assert plain.web_ui is True and plain.context_shift is False and plain.mmap is True
    assert plain.repack is None and plain.mlock is False and plain.kv_unified is False
    flipped = parser.parse_args(["serve", "-m", "x.gguf", "--no-webui", "--context-shift",
                                 "--no-mmap", "--no-repack", "-kvu", "-a", "name"])
    assert (flipped.web_ui, flipped.context_shift, flipped.mmap, flipped.repack,
            flipped.kv_unified, flipped.alias) == (False, True, False, False, True, "name")
