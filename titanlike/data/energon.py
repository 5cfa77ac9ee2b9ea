"""Datasets prepared with Megatron Energon (`energon prepare`), read without running energon (issue 31 item 2).

An Energon dataset is a folder of WebDataset tar shards plus `.nv-meta/`: `.info.json` (or the older
`.info.yaml`: samples per shard), `split.yaml` (or `split.json`: the shards of each split part, as
brace patterns such as `part_{000..009}.tar`, and `exclude`: shards or `shard/key` samples left
out), `dataset.yaml` (the sample type and how the shards' parts fill it) and index files. We read the
metadata with a safe YAML loader and hand the split part's shards, in their listed order, to the same
map-style tar reader as `training.dataset webdataset` (data/image_text.py), so the guarantees stay
ours: a sample is a pure function of its index (the same samples in the same order on any
data-parallel degree, exact resume), and nothing in the folder is ever executed. Energon's index
files are not read: the shards are indexed with tarfile, and each shard's sample count is checked
against `.info.json` (a shard changed since `energon prepare` is refused).

dataset.yaml, as `energon prepare` writes it (`sample_type: {__module__: megatron.energon, __class__: X}`
and `field_map`, or a top-level `__class__` for the older `XWebdataset` forms and CrudeWebdataset):

- CaptioningSample (image, caption): an image-caption pair;
- VQASample (image, context, answers, answer_weights): a one-turn conversation, the context as the user
  turn (the image before it unless it holds `<image>`), the answer with the largest weight (the first
  on ties; a single string as it is) as the assistant's;
- CrudeWebdataset: the raw parts, in titanlike's WebDataset convention (`txt` captions, `json`
  conversations in the SFT or LLaVA form, images `0.png`, `1.jpg`, ...).

A metadataset YAML (MetadatasetV2: per split, a blend of prepared folders with weights) names the
datasets and their weights; the blend itself is ours (deterministic by sample number), not energon's
random draw per rank.

A field is `part` or `part[key][index]...` into a JSON part, alternatives separated by commas (the
first that reads), as energon's field_map. Anything else is refused in one sentence: a
`sample_loader` / `part_filter` (Python files of the dataset energon would import), a class outside
megatron.energon, a sample type titanlike has no reading for, a part no safe decoder reads (energon
would unpickle `.pyd` parts), a shard outside the folder.
"""

from __future__ import annotations

import json
import os
import re

from titanlike.data.errors import DataError
from titanlike.data.shards import (IMAGE_MARK, IMAGE_SUFFIXES, Content, Member, _Skip, shard_samples,
                                   webdataset_content)

META = ".nv-meta"
# The part of an Energon split (train / val / test) a split of ours reads (train.py's held-out split is "valid").
ENERGON_PARTS = {"train": "train", "valid": "val", "validation": "val", "test": "test"}
# Energon skips tar members named __something__ (its own metadata).
_META_MEMBER = re.compile(r"__[^/]*__($|/)")
_FIELD = re.compile(r"^(?P<part>[^\[\]]+)(?P<keys>(?:\[[^\[\]]+\])*)$")
_TEXT_PARTS, _JSON_PARTS = ("txt", "text"), ("json", "jsn")
_MAX_META_BYTES = 64 << 20
# sample type -> (its fields a field_map may fill, the ones it must)
SAMPLE_TYPES = {"CaptioningSample": ({"image", "caption"}, {"image", "caption"}),
                "VQASample": ({"image", "context", "answers", "answer_weights"}, {"image", "context", "answers"})}
_OLD_FORMS = {"CaptioningWebdataset": "CaptioningSample", "VQAWebdataset": "VQASample"}
CRUDE = "CrudeWebdataset"


def is_energon_dataset(path: str) -> bool:
    return os.path.isdir(os.path.join(path, META))


# At most this many names from the brace patterns of one split.yaml (shards and excluded samples), and
# a pattern at most this long: a range such as `x_{0..999999999}.tar` is counted before it is expanded.
MAX_PATTERN_NAMES = 1_000_000
_MAX_PATTERN_CHARS = 4096
# A YAML file may repeat nodes through aliases (*name) by at most this many nodes in all: a 1 KB alias
# bomb ("billion laughs") would otherwise grow into billions of nodes in whatever walks it.
_MAX_ALIAS_NODES = 1_000_000


def _outer_brace(pattern: str) -> tuple[int, int] | None:
    """(start, end) of the first top-level `{...}` of a pattern, None for none."""
    depth, start = 0, None
    for i, c in enumerate(pattern):
        if c == "{":
            depth, start = depth + 1, (i if depth == 0 else start)
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                return start, i
    return None


def _alternatives(inner: str) -> list[str]:
    """The comma-separated options of a brace's inside, commas of nested braces kept."""
    options, level, piece = [], 0, ""
    for ch in inner:
        if ch == "," and level == 0:
            options.append(piece)
            piece = ""
            continue
        level += (ch == "{") - (ch == "}")
        piece += ch
    options.append(piece)
    return options


_SPAN = re.compile(r"(-?\d+)\.\.(-?\d+)")


def count_braces(pattern: str) -> int:
    """How many names expand_braces(pattern) gives, counted without making them."""
    brace = _outer_brace(pattern)
    if brace is None:
        return 1
    start, end = brace
    inner, rest = pattern[start + 1:end], count_braces(pattern[end + 1:])
    span = _SPAN.fullmatch(inner)
    if span:
        return (abs(int(span[2]) - int(span[1])) + 1) * rest
    options = _alternatives(inner)
    if len(options) == 1:
        return count_braces(inner) * rest
    return sum(count_braces(o) for o in options) * rest


def expand_braces(pattern: str) -> list[str]:
    """A shard pattern's names, as the braceexpand package energon uses: `{a,b}` alternatives and
    `{000..012}` ranges (zero padding kept), nested and several per pattern. Count them first
    (count_braces) where the pattern comes from a file."""
    brace = _outer_brace(pattern)
    if brace is None:
        return [pattern]
    start, end = brace
    inner, rest, head = pattern[start + 1:end], expand_braces(pattern[end + 1:]), pattern[:start]
    span = _SPAN.fullmatch(inner)
    if span:
        a, b = span.groups()
        width = max(len(a), len(b)) if a.startswith("0") or b.startswith("0") else 0
        step = 1 if int(b) >= int(a) else -1
        options = [str(n).zfill(width) for n in range(int(a), int(b) + step, step)]
    else:
        options = _alternatives(inner)
        if len(options) == 1:  # `{x}` is no alternative: kept as written
            return [head + "{" + o + "}" + r for o in expand_braces(inner) for r in rest]
        options = [x for o in options for x in expand_braces(o)]
    return [head + o + r for o in options for r in rest]


def _split_names(folder: str, patterns: list) -> list[list[str]]:
    """Each pattern of split.yaml expanded, after counting them all against MAX_PATTERN_NAMES."""
    total = 0
    for pattern in patterns:
        text = str(pattern)
        try:
            count = count_braces(text) if len(text) <= _MAX_PATTERN_CHARS else None
        except RecursionError:
            count = None
        if count is None:
            raise DataError(f"the Energon dataset {folder} has a shard pattern in {META}/split.yaml longer than "
                            f"{_MAX_PATTERN_CHARS} characters or nested too deeply ({text[:60]!r}...)")
        total += count
        if total > MAX_PATTERN_NAMES:
            raise DataError(f"the Energon dataset {folder} has shard patterns in {META}/split.yaml that name "
                            f"at least {total:,} shards ({text[:60]!r}), more than the {MAX_PATTERN_NAMES:,} titanlike "
                            "reads; list the shards it holds")
    return [expand_braces(str(pattern)) for pattern in patterns]


def _load_yaml(raw):
    """YAML with PyYAML's safe loader (no Python tags, no class is built), refusing a document whose
    aliases repeat more than _MAX_ALIAS_NODES nodes or refer to themselves."""
    import yaml  # PyYAML: a dependency of huggingface_hub, which titanlike requires

    class Loader(yaml.SafeLoader):
        def get_single_node(self):
            node = super().get_single_node()
            if node is not None:
                _check_aliases(node)
            return node

    return yaml.load(raw, Loader=Loader)


def _check_aliases(root) -> None:
    """ValueError when the node graph, each alias counted as a copy, exceeds the distinct nodes by more
    than _MAX_ALIAS_NODES, or holds a cycle. Sizes are memoised per node, so this is linear in the file."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ValueError("it has a YAML alias that refers to itself")
        children = node.value if isinstance(node.value, list) else []
        open_nodes.add(key)
        n = 1 + sum(size(c) for child in children for c in (child if isinstance(child, tuple) else (child,)))
        open_nodes.discard(key)
        sizes[key] = n
        return n

    if size(root) - len(sizes) > _MAX_ALIAS_NODES:
        raise ValueError(f"its YAML aliases (*name) repeat more than {_MAX_ALIAS_NODES:,} nodes (an alias bomb?)")


def _read_meta(folder: str, *names: str, required: bool = True):
    """The first of `names` under .nv-meta/, parsed (JSON or YAML, the safe loader: no Python tags)."""
    for name in names:
        path = os.path.join(folder, META, name)
        if not os.path.isfile(path):
            continue
        try:
            if os.path.getsize(path) > _MAX_META_BYTES:
                raise ValueError(f"it is larger than {_MAX_META_BYTES >> 20} MiB")
            with open(path, "rb") as f:
                raw = f.read()
            if name.endswith(".json"):
                return json.loads(raw)
            return _load_yaml(raw)
        except Exception as e:
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            raise DataError(f"the Energon dataset {folder} has a {META}/{name} that cannot be read "
                            f"({reason})") from None
    if required:
        raise DataError(f"the Energon dataset {folder} has no {META}/{' or '.join(names)}; run energon prepare on it")
    return None


def _parse_field(folder: str, name: str, spec) -> list[tuple[str, list[str]]]:
    """A field_map entry as its alternatives, each (part, keys into the part's JSON)."""
    if not isinstance(spec, str) or not spec:
        raise DataError(f"the Energon dataset {folder} maps field {name!r} to {spec!r}, not a part name")
    alternatives = []
    for option in spec.split(","):
        m = _FIELD.match(option.strip())
        if not m:
            raise DataError(f"the Energon dataset {folder} maps field {name!r} to {spec!r}, which is not "
                            "'part' or 'part[key]...'")
        part, keys = m["part"], re.findall(r"\[([^\[\]]+)\]", m["keys"])
        kind = part.rsplit(".", 1)[-1].lower()
        allowed = IMAGE_SUFFIXES if name == "image" else _TEXT_PARTS + _JSON_PARTS
        if kind not in allowed or (keys and kind not in _JSON_PARTS):
            what = "an image" if name == "image" else "text or JSON"
            raise DataError(f"the Energon dataset {folder} maps field {name!r} to {option!r}, which titanlike does "
                            f"not read as {what} (images: {', '.join(IMAGE_SUFFIXES)}; text: txt, or keys of a json "
                            "part)")
        alternatives.append((part, keys))
    return alternatives


def _sample_type(folder: str, config) -> str:
    """The sample type dataset.yaml names, refused in one sentence unless it is one we read with no code."""
    if not isinstance(config, dict):
        raise DataError(f"the Energon dataset {folder} has a {META}/dataset.yaml that is not a mapping")
    for key in ("sample_loader", "part_filter"):
        if key in config:
            raise DataError(f"the Energon dataset {folder} names a {key} ({config[key]!r}) in {META}/dataset.yaml: "
                            "Python code titanlike never runs; give it a field_map, or make it a CrudeWebdataset "
                            "in titanlike's WebDataset convention")

    def named(value, where: str) -> str:
        if not isinstance(value, dict) or value.get("__module__") != "megatron.energon" or \
                not isinstance(value.get("__class__"), str):
            raise DataError(f"the Energon dataset {folder} names {where} {value!r} in {META}/dataset.yaml, which is "
                            "not a class of megatron.energon; titanlike imports no class a dataset names")
        return value["__class__"]

    if "__class__" in config or "__module__" in config:
        cls = named({"__module__": config.get("__module__"), "__class__": config.get("__class__")}, "the class")
        kind = _OLD_FORMS.get(cls, cls)
    else:
        kind = named(config.get("sample_type"), "the sample type")
    if kind != CRUDE and kind not in SAMPLE_TYPES:
        raise DataError(f"the Energon dataset {folder} holds {kind} samples; titanlike reads "
                        f"{', '.join(sorted(SAMPLE_TYPES))} (with a field_map) and {CRUDE} datasets")
    return kind


def is_metadataset(path: str) -> bool:
    return os.path.isfile(path) and path.endswith((".yaml", ".yml"))


def metadataset_blend(path: str, part: str) -> list[tuple[str, float, str]]:
    """An Energon metadataset (MetadatasetV2 YAML: `splits: {train: {blend: [{weight, path, split_part},
    ...]}}`, or one `{path, split_part}` per split) as (dataset folder, weight, split part) for `part`.
    Its folders are read as above and blended by our deterministic rule (data/image_text.py), with
    energon's weights; what else a metadataset can say (join, blend_epochized, subset, aux, nested
    metadatasets) is refused in one sentence."""
    def fail(what: str):
        raise DataError(f"the Energon metadataset {path} {what}")

    try:
        if os.path.getsize(path) > _MAX_META_BYTES:
            raise ValueError(f"it is larger than {_MAX_META_BYTES >> 20} MiB")
        with open(path, "rb") as f:
            config = _load_yaml(f.read())
    except Exception as e:
        fail(f"cannot be read ({' '.join(str(e).split())[:160] or type(e).__name__})")
    if not isinstance(config, dict) or config.get("__module__") != "megatron.energon" or \
            config.get("__class__") != "MetadatasetV2" or not isinstance(config.get("splits"), dict):
        fail("is not a MetadatasetV2 of megatron.energon with splits (the form titanlike reads)")
    split = config["splits"].get(part)
    if split is None:
        fail(f"has no {part!r} split (it has {', '.join(map(str, config['splits'])) or 'none'})")
    entries = split.get("blend") if isinstance(split, dict) and "blend" in split else [split]
    if not isinstance(entries, list) or not entries:
        fail(f"has a {part!r} split that is neither a blend list nor one dataset")
    here = os.path.dirname(os.path.abspath(path))
    out = []
    for entry in entries:
        extra = set(entry) - {"path", "weight", "split_part", "subflavors"} if isinstance(entry, dict) else {"?"}
        if extra or not isinstance(entry.get("path"), str):
            fail(f"says {sorted(extra) or entry!r} in its {part!r} split; titanlike reads blends of "
                 "{path, weight, split_part} entries")
        folder = os.path.join(here, entry["path"])
        if not is_energon_dataset(folder):
            fail(f"names {entry['path']!r}, which is not a folder energon prepare made (nested metadatasets are "
                 "not read)")
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or not weight >= 0:
            fail(f"gives {entry['path']!r} the weight {weight!r}, not a non-negative number")
        out.append((folder, float(weight), str(entry.get("split_part") or part)))
    if sum(w for _, w, _ in out) <= 0:
        fail(f"gives its {part!r} split no positive weight")
    return out


class EnergonDataset:
    """One split part of an Energon-prepared folder: samples() yields (key, {extension: Member}) in
    the part's order (its shards as listed, each in tar order, excluded ones left out); content() reads
    one as data/image_text.Content."""

    def __init__(self, folder: str, part: str = "train"):
        self.folder, self.part = folder, part
        config = _read_meta(folder, "dataset.yaml")
        self.kind = _sample_type(folder, config)
        self.fields: dict[str, list[tuple[str, list[str]]]] = {}
        if self.kind != CRUDE:
            field_map = config.get("field_map")
            allowed, required = SAMPLE_TYPES[self.kind]
            if not isinstance(field_map, dict) or not required <= set(field_map) or not set(field_map) <= allowed:
                raise DataError(f"the Energon dataset {folder} needs a field_map in {META}/dataset.yaml filling "
                                f"{', '.join(sorted(required))} of its {self.kind} (of {', '.join(sorted(allowed))}), "
                                f"got {field_map!r}")
            self.fields = {name: _parse_field(folder, name, spec) for name, spec in field_map.items()}
        info = _read_meta(folder, ".info.json", ".info.yaml")
        counts = info.get("shard_counts") if isinstance(info, dict) else None
        split = _read_meta(folder, "split.yaml", "split.json")
        parts = split.get("split_parts") if isinstance(split, dict) else None
        if not isinstance(counts, dict) or not isinstance(parts, dict):
            raise DataError(f"the Energon dataset {folder} has no shard_counts in {META}/.info.json or no split_parts "
                            f"in {META}/split.yaml; run energon prepare on it")
        if not all(isinstance(v, list) for v in parts.values()) or not isinstance(split.get("exclude") or [], list):
            raise DataError(f"the Energon dataset {folder} has a {META}/split.yaml whose split_parts or exclude are "
                            "not lists of shard names")
        if not parts.get(part):
            raise DataError(f"the Energon dataset {folder} has no shards in its {part!r} split part (it has "
                            f"{', '.join(k for k, v in parts.items() if v) or 'none'})")
        exclude, listed = split.get("exclude") or [], parts[part]
        names = _split_names(folder, [*exclude, *listed])
        excluded = {name for expanded in names[:len(exclude)] for name in expanded}
        # Entries with a "/" may name "shard/key" samples (energon's rule; a shard name with a folder is both).
        self.excluded_samples = {e for e in excluded if "/" in e}
        root = os.path.normpath(os.path.abspath(folder))
        self.shards: list[tuple[str, str, int]] = []  # (name in the metadata, path, its sample count)
        for name in (n for expanded in names[len(exclude):] for n in expanded):
            if name in excluded:
                continue
            # Lexically inside (a shard linked from elsewhere is the owner's choice; `../` in a name is not).
            path = os.path.normpath(os.path.join(root, name))
            if not path.startswith(root + os.sep):
                raise DataError(f"the Energon dataset {folder} lists the shard {name!r}, which is outside the folder")
            if name not in counts:
                raise DataError(f"the Energon dataset {folder} lists the shard {name!r} in its {part!r} split part "
                                f"but not in {META}/.info.json; run energon prepare on it again")
            self.shards.append((name, path, counts[name]))

    def samples(self):
        for name, path, count in self.shards:
            samples = [(key, members) for key, members in shard_samples(path) if not _META_MEMBER.match(key)]
            if len(samples) != count:
                raise DataError(f"the shard {path} holds {len(samples)} samples but the Energon dataset's "
                                f"{META}/.info.json says {count}: it changed after energon prepare; prepare it again")
            for key, members in samples:
                if f"{name}/{key}" not in self.excluded_samples:
                    yield key, members

    def _field(self, name: str, members: dict[str, Member]):
        for part, keys in self.fields[name]:
            if part not in members:
                continue
            if name == "image":
                return members[part]
            raw = members[part].read()
            if part.rsplit(".", 1)[-1].lower() in _TEXT_PARTS:
                return raw.decode("utf-8", errors="replace")
            try:
                value = json.loads(raw)
                for key in keys:
                    value = value[int(key)] if isinstance(value, list) else value[key]
                return value
            except Exception:
                continue
        raise _Skip(f"parts the Energon field_map does not find ({name})")

    def content(self, members: dict[str, Member]) -> Content:
        if self.kind == CRUDE:
            return webdataset_content(members)
        image = self._field("image", members)
        if self.kind == "CaptioningSample":
            return Content([image], caption=str(self._field("caption", members)).strip())
        context, answers = str(self._field("context", members)), self._field("answers", members)
        if isinstance(answers, list):
            weights = self._field("answer_weights", members) if "answer_weights" in self.fields else None
            if not answers or (weights is not None and (not isinstance(weights, list) or len(weights) != len(answers))):
                raise _Skip("VQA samples with no answer, or answer weights that do not pair with the answers")
            best = max(range(len(answers)), key=lambda i: (float(weights[i]) if weights else 0.0, -i))
            answers = answers[best]
        if IMAGE_MARK not in context:
            context = f"{IMAGE_MARK}\n{context}"  # LLaVA's place for the image: before the question
        return Content([image], messages=[{"role": "user", "content": context},
                                          {"role": "assistant", "content": str(answers)}])

    def __repr__(self) -> str:
        return f"EnergonDataset({self.folder!r}, {self.part!r}, {self.kind}, {len(self.shards)} shards)"


__all__ = ["ENERGON_PARTS", "EnergonDataset", "MAX_PATTERN_NAMES", "SAMPLE_TYPES", "count_braces", "expand_braces",
           "is_energon_dataset", "is_metadataset", "metadataset_blend"]
