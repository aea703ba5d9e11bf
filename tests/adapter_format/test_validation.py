"""The shared validation rules: one adapter folder per rule, each failing with its own code; and
corrupt adapters failing alone and clearly: random damage to the weights file, the PEFT config
and the golden outputs gives ``AdapterValidationError`` (a 400/422 to the caller) and never another
exception, a hang or an allocation sized by a hostile header."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from loraplane.adapter_format import (
    AdapterValidationError,
    BaseShape,
    ErrorCode,
    ValidationLimits,
    adapter_digest,
    check_adapter_name,
    file_digest,
    read_safetensors_header,
    validate_adapter_dir,
)
from loraplane.adapter_format.digest import GOLDEN_FILE
from loraplane.adapter_format.golden import load_golden
from loraplane.adapter_format.sources import open_source

BASE = BaseShape(
    name="HuggingFaceTB/SmolLM2-135M-Instruct",
    revision="main",
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
)
PREFIX = "base_model.model.model.layers"


def lora_tensors(
    rank: int = 4, modules: tuple[str, ...] = ("q_proj", "v_proj"), dtype: Any = np.float32
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(BASE.num_layers):
        for module in modules:
            d_in, d_out = BASE.module_dims(module)
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            tensors[f"{PREFIX}.{layer}.{part}.{module}.lora_A.weight"] = rng.normal(size=(rank, d_in)).astype(dtype)
            tensors[f"{PREFIX}.{layer}.{part}.{module}.lora_B.weight"] = rng.normal(size=(d_out, rank)).astype(dtype)
    return tensors


def make_adapter(
    folder: Path, *, config: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None, rank: int = 4
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "revision": "main",
        "task_type": "CAUSAL_LM",
    }
    cfg.update(config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors if tensors is not None else lora_tensors(rank), str(folder / "adapter_model.safetensors"))
    return folder


def test_a_good_adapter_yields_its_manifest(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "good")
    m = validate_adapter_dir(folder, BASE, expected_digest=adapter_digest(folder))
    assert (m.rank, m.alpha, m.scaling) == (4, 8, 2.0)
    assert m.target_modules == ("q_proj", "v_proj") and m.layers == (0, 1)
    assert m.digest == file_digest(folder / "adapter_model.safetensors") and m.dtype == "F32" and not m.needs_truncation


def test_the_adapter_digest_covers_config_weights_and_golden_outputs(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "v1")
    weights, whole = file_digest(folder / "adapter_model.safetensors"), adapter_digest(folder)
    assert whole != weights
    m = validate_adapter_dir(folder, BASE, expected_digest=whole)
    assert (m.digest, m.adapter_digest, m.digest_scope) == (weights, whole, "adapter")
    # The earlier form (the weights alone) is refused by default, naming the digest to declare,
    # and accepted (saying so) only where a migration turned the requirement off.
    expect(ErrorCode.DIGEST_MISMATCH, folder, f"requires the adapter's digest {whole}", expected_digest=weights)
    lenient = ValidationLimits(require_adapter_digest=False)
    assert validate_adapter_dir(folder, BASE, lenient, expected_digest=weights).digest_scope == "weights"
    # A new lora_alpha over the same weights is another adapter: the declared adapter digest refuses
    # it, naming what the folder now hashes to; the weights-only digest cannot tell.
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 64}))
    expect(ErrorCode.DIGEST_MISMATCH, folder, f"adapter's digest is {adapter_digest(folder)}", expected_digest=whole)
    assert validate_adapter_dir(folder, BASE, lenient, expected_digest=weights).scaling == 16.0
    expect(ErrorCode.DIGEST_MISMATCH, folder, "covers only adapter_model.safetensors", expected_digest=weights)
    assert validate_adapter_dir(folder, BASE, expected_digest=adapter_digest(folder)).digest_scope == "adapter"
    # So does a change of the golden outputs alone.
    before = adapter_digest(folder)
    (folder / GOLDEN_FILE).write_text("{}")
    assert adapter_digest(folder) != before


def test_rslora_scaling(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "rs", config={"use_rslora": True, "lora_alpha": 8})
    assert validate_adapter_dir(folder, BASE).scaling == pytest.approx(8 / 2)


def test_per_module_ranks_and_alphas_as_peft_reads_its_patterns(tmp_path: Path) -> None:
    """``rank_pattern`` and ``alpha_pattern``: regular expressions matching the end of a module's
    name, the first match winning; each module's tensors at its own rank, the adapter's rank the
    largest (which the cap counts), and the modules whose scaling differs listed with it."""
    tensors = lora_tensors(rank=4)
    for layer in range(BASE.num_layers):
        d_in, d_out = BASE.module_dims("v_proj")
        rank = 8 if layer == 1 else 2
        tensors[f"{PREFIX}.{layer}.self_attn.v_proj.lora_A.weight"] = np.zeros((rank, d_in), np.float32)
        tensors[f"{PREFIX}.{layer}.self_attn.v_proj.lora_B.weight"] = np.zeros((d_out, rank), np.float32)
    config = {"rank_pattern": {r"layers\.1\.self_attn\.v_proj": 8, "v_proj": 2}, "alpha_pattern": {"q_proj": 2}}
    folder = make_adapter(tmp_path / "p", config=config, tensors=tensors)
    m = validate_adapter_dir(folder, BASE)
    assert (m.rank, m.scaling) == (8, 2.0)  # lora_alpha 8 over r 4, as PEFT's default for unmatched modules
    assert m.module_scalings == {(0, "q_proj"): 0.5, (1, "q_proj"): 0.5, (0, "v_proj"): 4.0, (1, "v_proj"): 1.0}
    expect(ErrorCode.RANK_OVER_CAP, folder, "rank 8 is above max_lora_rank 4", ValidationLimits(max_lora_rank=4))
    # The patterns' order decides, as PEFT's: "v_proj" first gives layer 1's v_proj rank 2, not its tensors'.
    swapped = {**config, "rank_pattern": {"v_proj": 2, r"layers\.1\.self_attn\.v_proj": 8}}
    expect(ErrorCode.SHAPE_MISMATCH, make_adapter(tmp_path / "o", config=swapped, tensors=tensors), "at rank 2")


@pytest.mark.parametrize(
    ("pattern", "match"),
    [("q_proj(", "not a regular expression"), (r"(.|.)*\d\d\d", "too long to match"), ("x" * 300, "longer than")],
)
def test_a_pattern_that_cannot_be_matched_safely_is_a_bad_config(tmp_path: Path, pattern: str, match: str) -> None:
    """A pattern comes from whoever uploaded the adapter: one that does not compile, or whose
    match would run for seconds (catastrophic backtracking), is refused, not run."""
    config = {"rank_pattern": {pattern: 4}}
    expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / "x", config=config), match)


def test_patterns_that_are_each_just_fast_enough_are_bounded_together(tmp_path: Path) -> None:
    """Each of these matches in about 6 ms, well under the per-match bound; 1,000 of them over
    four modules would take 24 s. All of a config's matches share one budget, so the validator
    answers within about a second."""
    config = {"rank_pattern": {rf"(.|.){{0,13}}\d\d\d(?#{i})": 4 for i in range(1000)}}
    started = time.monotonic()
    expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / "slow", config=config), "took longer than 1 s")
    assert time.monotonic() - started < 8


def expect(code: ErrorCode, folder: Path, match: str, limits: ValidationLimits = ValidationLimits(), **kw: Any) -> None:
    with pytest.raises(AdapterValidationError, match=match) as info:
        validate_adapter_dir(folder, BASE, limits, **kw)
    assert info.value.code is code


def test_pickle_files_are_refused(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "p")
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    expect(ErrorCode.PICKLE_REFUSED, folder, "adapter_model.bin: pickle files can run code")


def test_missing_weights(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "m")
    (folder / "adapter_model.safetensors").unlink()
    expect(ErrorCode.MISSING_FILE, folder, "adapter_model.safetensors is missing")


@pytest.mark.parametrize(("where", "says"), [("x" * 5_000, "cannot be read"), ("file-not-folder/sub", "is missing")])
def test_a_local_source_no_folder_can_be_is_missing_not_an_os_error(tmp_path: Path, where: str, says: str) -> None:
    """A path too long for the filesystem, or through a file, is a refused source (a permanent
    MissingFile the caller answers with 400), not an OSError a server turns into a 500."""
    (tmp_path / "file-not-folder").write_text("")
    with pytest.raises(AdapterValidationError) as err:
        open_source(str(tmp_path / where)).fetch(tmp_path)
    assert err.value.code == ErrorCode.MISSING_FILE and says in err.value.message
    assert len(str(err.value)) < 1_000


def test_a_home_of_no_user_is_a_missing_source_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``~name/...`` for a user this machine does not have (found by the admin fuzz test: a 500
    from ``Path.expanduser``) is a path like any other that is not there: a 400 to the caller."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterValidationError) as err:
        open_source("~no-such-user-on-this-machine/adapter").fetch(tmp_path)
    assert err.value.code == ErrorCode.MISSING_FILE


def test_digest_mismatch(tmp_path: Path) -> None:
    expect(
        ErrorCode.DIGEST_MISMATCH,
        make_adapter(tmp_path / "d"),
        "manifest declares sha256:0000",
        expected_digest="sha256:" + "0" * 64,
    )


def test_malformed_digest(tmp_path: Path) -> None:
    expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / "d"), "not of the form sha256:", expected_digest="md5:abc")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"revision": "v2"}, "revision 'v2' of its base, this base is revision 'main'"),
        ({"base_model_name_or_path": "meta-llama/Llama-3.1-8B"}, "trained on 'meta-llama/Llama-3.1-8B'"),
        # Another organisation's model of the same name is another model.
        ({"base_model_name_or_path": "someone-else/SmolLM2-135M-Instruct"}, "trained on 'someone-else/"),
    ],
)
def test_other_base_is_refused(tmp_path: Path, config: dict[str, Any], match: str) -> None:
    expect(ErrorCode.BASE_MISMATCH, make_adapter(tmp_path / "b", config=config), match)


@pytest.mark.parametrize(
    "declared", ["HuggingFaceTB/SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct", "/data/SmolLM2-135M-Instruct",
                 "./models/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct"],
)  # fmt: skip
def test_the_same_base_by_hub_id_or_by_the_path_it_was_loaded_from_is_accepted(tmp_path: Path, declared: str) -> None:
    config = {"base_model_name_or_path": declared}
    assert validate_adapter_dir(make_adapter(tmp_path / "same", config=config), BASE).rank > 0


def test_rank_over_cap_unless_truncation_opted_in(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "r", rank=16)
    expect(ErrorCode.RANK_OVER_CAP, folder, "rank 16 is greater than max_lora_rank 8", ValidationLimits(max_lora_rank=8))
    m = validate_adapter_dir(folder, BASE, ValidationLimits(max_lora_rank=8, allow_rank_truncation=True))
    assert m.needs_truncation


def test_a_declared_rank_over_the_cap_is_refused_before_the_tensors_are_compared(tmp_path: Path) -> None:
    """The config says r=128 and the tensors disagree with it: the rank over ``max_lora_rank`` is
    what the user hears (vLLM's own test expects that message), not a shape mismatch."""
    folder = make_adapter(tmp_path / "r", config={"r": 128, "lora_alpha": 256}, rank=4)
    expect(ErrorCode.RANK_OVER_CAP, folder, "LoRA rank 128 is greater than max_lora_rank 16", ValidationLimits(max_lora_rank=16))


def test_oversized_headers_configs_and_golden_files_are_refused_before_they_are_parsed(tmp_path: Path) -> None:
    """A namespace user's adapter cannot make the operator parse a header, config or golden file of
    hundreds of MiB: each has a cap checked before its bytes are read (sparse files here: their
    size is past the cap, nothing is written), refused as TooLarge. A real adapter's are far below."""
    from loraplane.adapter_format.golden import MAX_GOLDEN_BYTES
    from loraplane.adapter_format.peft_config import MAX_CONFIG_BYTES
    from loraplane.adapter_format.safetensors_header import MAX_HEADER_BYTES

    bomb = make_adapter(tmp_path / "header")
    with (bomb / "adapter_model.safetensors").open("wb") as fh:
        fh.write(struct.pack("<Q", 100 * 2**20))
        fh.truncate(8 + 100 * 2**20 + 16)
    expect(ErrorCode.TOO_LARGE, bomb, "header is above the limit")
    config = make_adapter(tmp_path / "config")
    with (config / "adapter_config.json").open("ab") as fh:
        fh.truncate(MAX_CONFIG_BYTES + 1)
    expect(ErrorCode.TOO_LARGE, config, "adapter_config.json is larger than its limit")
    golden = make_adapter(tmp_path / "golden")
    with (golden / GOLDEN_FILE).open("wb") as fh:
        fh.truncate(MAX_GOLDEN_BYTES + 1)
    expect(ErrorCode.TOO_LARGE, golden, f"{GOLDEN_FILE} is larger than its limit")
    # A 128-layer model's adapter on all seven projections: its header's tensor names and entries.
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    header = {
        f"{PREFIX}.{layer}.self_attn.{module}.lora_{ab}.weight": {"dtype": "BF16", "shape": [64, 28672],
                                                                 "data_offsets": [10**10, 10**10 + 64 * 28672 * 2]}
        for layer in range(128) for module in modules for ab in "AB"
    }  # fmt: skip
    assert len(header) == 1792 and len(json.dumps(header)) * 10 < MAX_HEADER_BYTES


def test_unsupported_target_module(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "t", config={"target_modules": ["q_proj", "lm_head"]})
    expect(ErrorCode.UNSUPPORTED_TARGET, folder, r"target_modules \['lm_head'\] are not supported")


def test_shape_that_does_not_fit_the_base(tmp_path: Path) -> None:
    tensors = lora_tensors()
    tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 65), np.float32)
    expect(ErrorCode.SHAPE_MISMATCH, make_adapter(tmp_path / "s", tensors=tensors), r"shape \[4, 65\], the base needs \[4, 64\]")


def test_layer_beyond_the_base(tmp_path: Path) -> None:
    tensors = lora_tensors()
    tensors[f"{PREFIX}.7.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 64), np.float32)
    expect(ErrorCode.SHAPE_MISMATCH, make_adapter(tmp_path / "l", tensors=tensors), "layer 7, the base has 2 layers")


def test_half_a_pair(tmp_path: Path) -> None:
    tensors = lora_tensors()
    del tensors[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"]
    expect(ErrorCode.SHAPE_MISMATCH, make_adapter(tmp_path / "h", tensors=tensors), "layer 1 v_proj has no lora_B")


def test_names_that_match_nothing_fail_instead_of_loading_as_a_no_op(tmp_path: Path) -> None:
    expect(ErrorCode.NO_MATCHING_TENSORS, make_adapter(tmp_path / "n", tensors={}), "silent no-op")
    stray = {"transformer.h.0.attn.c_attn.lora_A.weight": np.zeros((4, 64), np.float32)}
    expect(ErrorCode.UNSUPPORTED_TARGET, make_adapter(tmp_path / "g", tensors=stray), "not a LoRA A/B weight")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nan_and_inf_are_refused(tmp_path: Path, dtype: Any) -> None:
    tensors = lora_tensors(dtype=dtype)
    tensors[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"][3, 2] = np.inf
    expect(ErrorCode.CORRUPT_SAFETENSORS, make_adapter(tmp_path / "x", tensors=tensors), "contains NaN or Inf")
    tensors[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"][3, 2] = np.nan
    expect(ErrorCode.CORRUPT_SAFETENSORS, make_adapter(tmp_path / "y", tensors=tensors), "contains NaN or Inf")


def test_truncated_and_garbage_safetensors(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "c")
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 10])
    expect(ErrorCode.CORRUPT_SAFETENSORS, folder, "do not match its shape or the file size")
    weights.write_bytes(b"\xff" * 100)
    expect(ErrorCode.CORRUPT_SAFETENSORS, folder, "does not fit")
    weights.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    expect(ErrorCode.CORRUPT_SAFETENSORS, folder, "not valid JSON")


def test_bad_config(tmp_path: Path) -> None:
    expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / "a", config={"r": 0}), "r: Input should be greater than 0")
    expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / "b", config={"use_dora": True}), "DoRA")
    # PEFT's other LoRA variants, its initialisations that change the base, layer replication; as
    # PEFT saves the plain ones, with each of these null or false, they are served.
    for i, (extra, match) in enumerate((
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens: a PEFT LoRA variant"),
        ({"use_qalora": True}, "use_qalora"), ({"arrow_config": {"top_k": 2}}, "arrow_config"),
        ({"velora_config": {}}, "velora_config"), ({"init_lora_weights": "lora_ga"}, "changed base"),
        ({"init_lora_weights": "mica"}, "init_lora_weights='mica'"),
        ({"init_lora_weights": "pissa_niter_16"}, "path_initial_model_for_weight_conversion"),
        ({"init_lora_weights": "olora"}, "changed base"), ({"layer_replication": [[0, 2]]}, "layer_replication"),
    )):  # fmt: skip
        expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / f"variant{i}", config=extra), match)
    plain = {"use_qalora": False, "alora_invocation_tokens": [], "arrow_config": None, "layer_replication": None,
             "init_lora_weights": True, "use_bdlora": None, "kasa_config": None}  # fmt: skip
    validate_adapter_dir(make_adapter(tmp_path / "plain", config=plain), BASE, ValidationLimits())
    expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / "c", config={"peft_type": "IA3"}), "not LORA")
    folder = make_adapter(tmp_path / "d")
    (folder / "adapter_config.json").write_text("{not json")
    expect(ErrorCode.BAD_CONFIG, folder, "not readable JSON")
    # Python's JSON reader takes Infinity and NaN: a scaling must still be a finite number.
    for i, alpha in enumerate((float("inf"), float("nan"), 1e300)):
        expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / f"alpha{i}", config={"lora_alpha": alpha}), "lora_alpha")
    expect(ErrorCode.BAD_CONFIG, make_adapter(tmp_path / "r", config={"r": 10**9}), "r: Input should be less than")


def test_size_limit(tmp_path: Path) -> None:
    expect(ErrorCode.TOO_LARGE, make_adapter(tmp_path / "big"), "the limit is 100", ValidationLimits(max_bytes=100))


@pytest.mark.parametrize("name", ["../etc", "a/b", "UPPER", "-lead", "x" * 200, "a..b", ""])
def test_unsafe_names(name: str) -> None:
    with pytest.raises(AdapterValidationError) as info:
        check_adapter_name(name)
    assert info.value.code is ErrorCode.UNSAFE_NAME


def test_safe_names_pass() -> None:
    for name in ("acme-support", "acme.support-v2", "a", "tenant_1.adapter"):
        assert check_adapter_name(name) == name


def test_header_reader_agrees_with_the_safetensors_library(tmp_path: Path) -> None:
    from safetensors import safe_open

    folder = make_adapter(tmp_path / "h")
    ours = read_safetensors_header(folder / "adapter_model.safetensors")
    with safe_open(str(folder / "adapter_model.safetensors"), framework="numpy") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            assert ours[key].shape == f.get_tensor(key).shape


# Damaged files per fuzz test: 750 each (3,000 in a test run); a longer run sets more, e.g.
# LORAPLANE_FUZZ_EXAMPLES=100000 (docs/security.md).
EXAMPLES = int(os.environ.get("LORAPLANE_FUZZ_EXAMPLES", "750"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# What reading one damaged adapter may allocate at its peak. The files are a few KiB; a reader
# that trusted a declared length (up to 2^64) would allocate that instead, or die trying.
PEAK_BYTES = 64 << 20


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("good") / "adapter")


def _copy(good: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    for f in good.iterdir():
        (into / f.name).write_bytes(f.read_bytes())
    return into


@contextlib.contextmanager
def _bounded_memory() -> Iterator[None]:
    """Fails when the body's peak traced allocation (Python and numpy) passes ``PEAK_BYTES``."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"reading one damaged adapter allocated {peak / 2**20:.0f} MiB at its peak"


def _refused_or_valid(folder: Path) -> None:
    with _bounded_memory(), contextlib.suppress(AdapterValidationError):
        validate_adapter_dir(folder, BASE)


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(min_value=0)))  # fmt: skip
def test_damaged_weights_fail_with_a_validation_error(good: Path, tmp_path_factory, edits, cut) -> None:
    folder = _copy(good, tmp_path_factory.mktemp("weights"))
    data = bytearray((folder / "adapter_model.safetensors").read_bytes())
    for at, value in edits:
        data[at % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    (folder / "adapter_model.safetensors").write_bytes(bytes(data))
    _refused_or_valid(folder)


@SETTINGS
@given(header=st.dictionaries(st.text(max_size=12), st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12,
), max_size=6), declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)))  # fmt: skip
def test_hostile_safetensors_headers_fail_with_a_validation_error(good: Path, tmp_path_factory, header, declared) -> None:
    """Any JSON as the header, and any declared header length (up to 2^64), against a small file."""
    folder = _copy(good, tmp_path_factory.mktemp("header"))
    raw = json.dumps(header).encode()
    size = len(raw) if declared is None else declared
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", size) + raw + b"\0" * 64)
    _refused_or_valid(folder)


@SETTINGS
@given(config=st.dictionaries(
    st.sampled_from(["peft_type", "r", "lora_alpha", "target_modules", "base_model_name_or_path", "revision",
                     "use_rslora", "task_type", "lora_dropout", "rank_pattern", "alpha_pattern", "bias", "extra"]),
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
    | st.lists(st.text(max_size=8) | st.integers(), max_size=4) | st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
    max_size=10,
), raw=st.one_of(st.none(), st.binary(max_size=64)))  # fmt: skip
def test_damaged_configs_fail_with_a_validation_error(good: Path, tmp_path_factory, config, raw) -> None:
    folder = _copy(good, tmp_path_factory.mktemp("config"))
    path = folder / "adapter_config.json"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    _refused_or_valid(folder)


@SETTINGS
@given(body=st.one_of(
    st.binary(max_size=64),
    st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                     st.sampled_from(["cases", "prompt", "token_ids", "logprobs", "adapter", "x"]), inner, max_size=4),
                 max_leaves=16).map(lambda v: json.dumps(v).encode()),
))  # fmt: skip
def test_damaged_golden_outputs_fail_with_a_validation_error(tmp_path_factory, body: bytes) -> None:
    folder = tmp_path_factory.mktemp("golden")
    (folder / GOLDEN_FILE).write_bytes(body)
    with _bounded_memory(), contextlib.suppress(AdapterValidationError):
        load_golden(folder)


def test_json_nested_past_the_parser_is_a_validation_error(good: Path, tmp_path: Path) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    folder = _copy(good, tmp_path / "deep")
    (folder / "adapter_config.json").write_bytes(deep)
    with pytest.raises(AdapterValidationError):
        validate_adapter_dir(folder, BASE)
    (folder / GOLDEN_FILE).write_bytes(deep)
    with pytest.raises(AdapterValidationError):
        load_golden(folder)
