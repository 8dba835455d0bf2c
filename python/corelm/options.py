"""Every option name corelm accepts, spelled once: weight formats, KV-cache types, activation precision,
work schedules, NUMA policies and convert's pruning methods. The Python API, every CLI command, convert,
the loaders and the calls into the C++ core (`corelm._core`, whose own name tables `_core.option_names()`
must agree, see tests/loaders/test_options.py) read them from here. A weight format's block and bytes per
block are the core's traits row (`core_formats()`), not written here.

    fmt = weight_format("q8")        # -> WEIGHT_FORMATS["q8_0"]
    choose("kv_cache_dtype", "i8")   # -> "int8"
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple


@functools.lru_cache(maxsize=None)
def core_formats() -> Dict[str, Dict[str, Any]]:
    """The C++ core's traits row of every weight type by its core name (`_core.weight_formats()`,
    cpp/formats/traits.h): blocks, bytes, GGUF names and ids, kinds, fp16 field offsets. The one place sizes are
    written; the names users write stay below."""
    from . import _core      # lazily: importing the option names needs no C++ core
    return {row["name"]: row for row in _core.weight_formats()}


@dataclass(frozen=True)
class WeightFormat:
    """How a matrix's weights are stored."""
    name: str                   # the canonical name users write (dtype=, --dtype, --weights)
    aliases: Tuple[str, ...]
    core: str                   # the C++ core's name (WeightType) and the packed type `Model.weight_type` reports
    file_type: str              # the tensor type in a corelm weights file (docs/model-format.md)
    gguf: Optional[str]         # the GGUF block type with the same bytes, kept as stored when loading GGUF
    description: str
    from_floats: bool = True    # the core quantizes float weights into it (else: only a GGUF's own blocks)
    # Exact zeros (quantized: zero codes) are dropped, so a matrix's bytes follow its sparsity: a bitmap of
    # 1 bit per weight plus the non-zeros (docs/model-format.md); block and block_bytes are then the dense
    # form's (every weight non-zero).
    sparse: bool = False
    raw_name: Optional[str] = None  # Model.set_weight_raw's name for it where that is not a GGUF type

    @property
    def block(self) -> int:
        """Weights per block along a row (1: plain floats; a sparse format's dense form's), from the core's
        traits row (cpp/formats/traits.h)."""
        return core_formats()[self.core]["block"]

    @property
    def block_bytes(self) -> int:
        """Bytes per block, scales included, from the core's traits row."""
        return core_formats()[self.core]["block_bytes"]

    @property
    def raw(self) -> Optional[str]:
        """The name `Model.set_weight_raw` takes this format's matrices under (`_core.option_names()
        ["raw_weight"]`): the GGUF block type, "BF16" / "SBF16" for bf16 rows (the latter stored sparse), or
        "SQ8" / "SQ4" for Q8_0 / Q4_0 blocks stored sparse."""
        return self.raw_name or self.gguf

    @property
    def bits(self) -> Optional[float]:
        """Bits per weight, scales included; None for a sparse format (a bit per weight, the non-zeros' bits
        and, quantized, the dense scales)."""
        return None if self.sparse else 8 * self.block_bytes / self.block


WEIGHT_FORMATS: Dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("fp32", ("f32", "float32"), "fp32", "f32", None, "32-bit floats"),
    WeightFormat("bf16", ("bfloat16",), "bf16", "bf16", None, "bfloat16 (half the bytes of fp32)",
                 raw_name="BF16"),
    WeightFormat("sbf16", ("sparse_bf16", "bf16_sparse"), "sbf16", "sbf16", None,
                 "unstructured-sparse bfloat16: a bitmap of the non-zeros and their values (SparAMX); zeros "
                 "cost 1 bit", sparse=True, raw_name="SBF16"),
    WeightFormat("sq8_0", ("sq8", "sparse_q8"), "sq8", "sq8", None,
                 "unstructured-sparse q8_0: a bitmap of the non-zero codes, the dense blocks' fp16 scales and the "
                 "non-zero int8 codes; zeros cost 1 bit", sparse=True, raw_name="SQ8"),
    WeightFormat("sq4_0", ("sq4", "sparse_q4"), "sq4", "sq4", None,
                 "unstructured-sparse q4_0: a bitmap of the non-zero codes (q != 8), the dense blocks' fp16 scales "
                 "and the non-zero 4-bit codes; zeros cost 1 bit", sparse=True, raw_name="SQ4"),
    WeightFormat("q8_0", ("q8",), "q8", "q8", "Q8_0", "blocks of 32 int8 with an fp16 scale, as ggml's Q8_0"),
    WeightFormat("q4_0", ("q4",), "q4", "q4", "Q4_0",
                 "blocks of 32 4-bit codes with an fp16 scale, as ggml's Q4_0"),
    WeightFormat("q4_1", ("q4m",), "q4m", "q4m", "Q4_1",
                 "blocks of 32 4-bit codes with an fp16 scale and minimum, as ggml's Q4_1"),
) + tuple(WeightFormat(name, (), name, name, name.upper(), what, from_floats=False) for name, what in (
    ("q5_0", "ggml's Q5_0: blocks of 32 5-bit codes with an fp16 scale"),
    ("q5_1", "ggml's Q5_1: blocks of 32 5-bit codes with an fp16 scale and minimum"),
    ("q2_k", "ggml's Q2_K: 2-bit codes, 4-bit scales and minimums per 16, fp16 super-block scales"),
    ("q3_k", "ggml's Q3_K: 3-bit codes, 6-bit scales per 16, an fp16 super-block scale"),
    ("q4_k", "ggml's Q4_K: 4-bit codes, 6-bit scales and minimums per 32, fp16 super-block scales"),
    ("q5_k", "ggml's Q5_K: 5-bit codes, 6-bit scales and minimums per 32, fp16 super-block scales"),
    ("q6_k", "ggml's Q6_K: 6-bit codes, 8-bit scales per 16, an fp16 super-block scale"),
    ("iq4_nl", "ggml's IQ4_NL: blocks of 32 4-bit indices into a fixed non-linear table, fp16 scale"),
    ("iq4_xs", "ggml's IQ4_XS: IQ4_NL's table, 6-bit scales per 32, an fp16 super-block scale"),
))}
QUANTIZED = ("q8_0", "q4_0", "q4_1")
# Formats that exist only as a GGUF's own blocks, multiplied as stored (kernels/ggml_formats.h).
GGUF_BLOCK_FORMATS = tuple(f.name for f in WEIGHT_FORMATS.values() if not f.from_floats)
# Formats that drop exact zeros or zero codes (a bitmap of the non-zeros, then their values).
SPARSE = tuple(f.name for f in WEIGHT_FORMATS.values() if f.sparse)
# The formats a float matrix can be packed into at load (dtype=).
PACKABLE = tuple(f.name for f in WEIGHT_FORMATS.values() if f.from_floats)
# What `corelm convert --weights` stores: sparse storage is bf16 with --sparsity, not a weights kind of its
# own (so the LLM(path, weights=...) cache has one folder per kind). The K-quants are written only by
# convert (cpp/kernels/quantize.h), never packed at load; q4_k_m / q5_k_m are llama.cpp's mixes of them.
K_QUANT_TARGETS = ("q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m")
CONVERT_TARGETS = tuple(n for n in PACKABLE if n not in SPARSE) + K_QUANT_TARGETS

# Stored formats that loading keeps as they are (repacked, never dequantized) under each dtype: "auto"
# keeps every quantized GGUF type; a 4-bit dtype keeps 8-bit blocks too rather than quantize a quantized
# tensor again, and every quantized dtype keeps the formats that exist only as GGUF blocks (the core
# cannot quantize into them). Sparse matrices stay sparse under every dtype but fp32 (their zeros were
# chosen; quantizing or densifying them would undo that); fp32 expands everything to floats.
KEEP_AS_STORED: Dict[str, Tuple[str, ...]] = {
    "auto": QUANTIZED + GGUF_BLOCK_FORMATS + SPARSE, "bf16": SPARSE, "sbf16": SPARSE,
    "q8_0": ("q8_0",) + GGUF_BLOCK_FORMATS + SPARSE,
    "q4_0": QUANTIZED + GGUF_BLOCK_FORMATS + SPARSE, "q4_1": QUANTIZED + GGUF_BLOCK_FORMATS + SPARSE,
    "sq8_0": ("q8_0",) + GGUF_BLOCK_FORMATS + SPARSE, "sq4_0": QUANTIZED + GGUF_BLOCK_FORMATS + SPARSE,
}
# The sparse format convert --sparsity stores each --weights kind's matrices in.
SPARSE_OF = {"bf16": "sbf16", "q8_0": "sq8_0", "q4_0": "sq4_0"}


@dataclass(frozen=True)
class Choice:
    """One option: its canonical values (the first is the default unless `default` says otherwise),
    other accepted spellings, and what the option is called in errors."""
    option: str
    values: Tuple[str, ...]
    aliases: Dict[str, str]
    help: str


def _formats_aliases() -> Dict[str, str]:
    return {a: f.name for f in WEIGHT_FORMATS.values() for a in f.aliases}


CHOICES: Dict[str, Choice] = {c.option: c for c in (
    Choice("dtype", ("auto",) + PACKABLE, _formats_aliases(),
           "matrix weights at load: auto (a GGUF's quantized blocks as stored, else bf16 where the CPU has "
           "AVX512_BF16, else fp32), or a weight format to convert to"),
    Choice("weights", CONVERT_TARGETS,
           {a: n for a, n in _formats_aliases().items() if n in CONVERT_TARGETS},
           "what `corelm convert` stores matrices as"),
    Choice("prune", ("wanda", "magnitude"), {},
           "how `corelm convert --sparsity` picks the weights to zero in each row: the smallest |W| * "
           "sqrt(mean square of the activation each multiplies on a calibration text) (wanda), or the "
           "smallest |W| (magnitude)"),
    Choice("kv_cache_dtype", ("auto", "fp32", "bf16", "int8"), {"f32": "fp32", "i8": "int8"},
           "precision of the KV cache: auto is bf16 where the matrices are bf16 or quantized, fp32 where "
           "they are fp32 (the model's own precision, as vLLM and llama.cpp do)"),
    Choice("activations", ("auto", "int8", "int16"), {"i8": "int8", "i16": "int16"},
           "input of matmuls with quantized weights, per block of 32: int16 (about 15 bits, close to fp32: "
           "the model answers as its file does; what auto picks) or int8 (faster prefill, less exact)"),
    Choice("schedule", ("dynamic", "static"), {},
           "how kernels split work across threads: by measured thread speed, stealing leftovers "
           "(dynamic), or in equal parts (static)"),
    Choice("numa", ("distribute", "isolate"), {},
           "distribute: threads on every NUMA node, each matrix's rows and the KV cache split by node; "
           "isolate: threads and memory on the node corelm started on (default: neither)"),
)}


def choose(option: str, value) -> str:
    """The canonical spelling of `value` for `option`; ValueError naming the option and its choices."""
    c = CHOICES[option]
    if isinstance(value, str):
        v = value.strip().lower()
        if v in c.values:
            return v
        if v in c.aliases:
            return c.aliases[v]
    raise ValueError(f"{option} must be one of {', '.join(c.values)}, got {value!r}.")


def choose_optional(option: str, value) -> Optional[str]:
    """As choose, with None passed through (the option's default)."""
    return None if value is None else choose(option, value)


def weight_format(name: str) -> WeightFormat:
    """The WeightFormat for a canonical name or alias (ValueError otherwise)."""
    key = name.strip().lower() if isinstance(name, str) else name
    key = _formats_aliases().get(key, key)
    if key in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[key]
    return WEIGHT_FORMATS[choose("weights", name)]


def format_of_core(core_name: str) -> WeightFormat:
    """The WeightFormat the C++ core calls `core_name` (e.g. "q4m")."""
    for f in WEIGHT_FORMATS.values():
        if f.core == core_name:
            return f
    raise KeyError(core_name)


def format_of_gguf(gguf_type: str) -> Optional[WeightFormat]:
    """The WeightFormat whose blocks are this GGUF type's, or None."""
    return next((f for f in WEIGHT_FORMATS.values() if f.gguf == gguf_type), None)


def format_of_raw(raw_name: str) -> Optional[WeightFormat]:
    """The WeightFormat `Model.set_weight_raw` calls `raw_name` (a GGUF type or "SBF16"), or None."""
    return next((f for f in WEIGHT_FORMATS.values() if f.raw == raw_name), None)


def format_of_file_type(file_type: str) -> WeightFormat:
    for f in WEIGHT_FORMATS.values():
        if f.file_type == file_type:
            return f
    raise KeyError(file_type)


def argparse_choices(option: str) -> Tuple[str, ...]:
    """Values a CLI flag accepts: canonical names and aliases."""
    c = CHOICES[option]
    return c.values + tuple(c.aliases)
