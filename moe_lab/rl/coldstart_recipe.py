"""What a results folder keeps of each cold start instead of its weights: the recipe and the weights' digest.

The weights are re-made from the recipe, so they stay out of git (each is about 14 MB). The recipe is
``<results>/coldstarts/<key>.json`` (``ResultsFolder.coldstart_recipe``). It holds the cache key, the config
sections the key hashes, the kernel pins, the seed, the code commit, the processor it was warmed on and the
digest. The runner writes it after a cold start. The runner (on resume) and `moe-lab verify` re-make a cold
start that is not at hand and compare digests. On the recorded processor they must be equal: the same config,
code and kernels give the same bits. On another processor the warm-up may take other steps, so a different
digest is said to come from a different processor, not called a fault.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moe_lab.config import ConfigError, RunConfig
from moe_lab.rl.coldstart import META_FILE, cache_key, cache_root, keyed_sections, kernel_pins
from moe_lab.store.cpuinfo import identity_differences, processor_info, processor_name
from moe_lab.store.run_folder import ResultsFolder
from moe_lab.store.files import atomic_write_text
from moe_lab.store.runlog import git_commit, package_versions

DIGEST_PREFIX = "sha256:"
EQUAL, DIFFERS, OTHER_PROCESSOR = "equal", "differs", "other processor"


def weights_digest(entry: Path) -> str:
    """sha256 over every tensor of the entry's *.safetensors, by name: name, dtype, shape and raw bytes. The
    file layout (shards, header order) does not enter, only the weights."""
    import safetensors
    import torch

    h = hashlib.sha256()
    tensors = {}
    for path in sorted(Path(entry).glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="pt") as fh:
            tensors.update({name: fh.get_tensor(name) for name in fh.keys()})
    if not tensors:
        raise ValueError(f"{entry}: no *.safetensors weights to digest")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode("utf-8"))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return DIGEST_PREFIX + h.hexdigest()


def make_recipe(cfg: RunConfig, entry: Path) -> dict:
    """The recipe of the cold start of ``cfg`` held in the cache entry ``entry`` (its coldstart.json read)."""
    meta = json.loads((Path(entry) / META_FILE).read_text(encoding="utf-8"))
    return {"key": cache_key(cfg), "config": keyed_sections(cfg), "pins": kernel_pins(), "seed": cfg.model.seed,
            "code_commit": git_commit(), "steps": meta.get("steps"), "accuracy": meta.get("accuracy"),
            "processor": processor_info(), "versions": package_versions(), "digest": weights_digest(entry)}


def recipe_config(recipe: dict, cache_dir: str | Path | None = None) -> RunConfig:
    """A config that re-makes the recipe's cold start (its sections; every other field at its default)."""
    from moe_lab.config import from_dict, validate

    data = json.loads(json.dumps(recipe["config"]))
    if cache_dir is not None:
        data["coldstart"]["cache_dir"] = str(cache_dir)
    return validate(from_dict(data))


def read_recipe(results: ResultsFolder, key: str) -> dict | None:
    """The folder's recipe for ``key``; None without one; a ConfigError naming the file when unreadable."""
    path = results.coldstart_recipe(key)
    if not path.is_file():
        return None
    try:
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a cold-start recipe ({exc}); expected the JSON `moe-lab run` writes") from None
    if not isinstance(recipe, dict) or recipe.get("key") != key or not str(recipe.get("digest", "")).startswith(
            DIGEST_PREFIX):
        raise ConfigError(f"{path}: not the recipe of cold start {key[:12]}; expected its 'key' and a "
                          f"'digest' starting {DIGEST_PREFIX!r}")
    return recipe


def write_recipe(results: ResultsFolder, cfg: RunConfig) -> dict:
    """Write the recipe of cfg's cold start (from this machine's cache entry) unless the folder holds one."""
    key = cache_key(cfg)
    recipe = read_recipe(results, key)
    if recipe is None:
        recipe = make_recipe(cfg, cache_root(cfg) / key)
        results.coldstarts_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(results.coldstart_recipe(key), json.dumps(recipe, indent=1, sort_keys=True) + "\n")
    return recipe


def compare(recipe: dict, digest: str, processor: dict | None = None) -> tuple[str, str]:
    """(EQUAL | DIFFERS | OTHER_PROCESSOR, one phrase) for a re-made cold start's digest against the recipe's.
    DIFFERS: other weights on the recorded processor (the phrase names the packages that differ, if any)."""
    key = str(recipe["key"])[:12]
    if digest == recipe["digest"]:
        return EQUAL, f"cold start {key} re-made with its recipe's digest"
    found = f"cold start {key}: digest {_short(digest)} against the recipe's {_short(recipe['digest'])}"
    here = processor if processor is not None else processor_info()
    differences = identity_differences(recipe.get("processor") or {}, here)
    if differences:
        return OTHER_PROCESSOR, f"{found}: different processor ({'; '.join(differences)})"
    now = package_versions()
    packages = [f"{p} {v} vs {now.get(p)}" for p, v in (recipe.get("versions") or {}).items()
                if p != "moe_lab" and now.get(p) != v]
    return DIFFERS, (f"{found} on the same processor ({processor_name(here)})"
                     + (f"; packages differ ({'; '.join(packages)})" if packages else "")
                     + f"; recipe made at code {str(recipe.get('code_commit'))[:10]}")


def _short(digest: str) -> str:
    return digest[len(DIGEST_PREFIX):][:12] if digest.startswith(DIGEST_PREFIX) else digest[:12]


def remaking_line(path: Path, recipe: dict, where: str) -> str:
    """The progress line of a cold start re-made from its recipe at ``path`` (``where``: why it is not at hand)."""
    return (f"cold start {str(recipe['key'])[:12]}: {where}; re-making it from its recipe {path} "
            f"({recipe.get('steps')} supervised steps recorded)")


def before_cold_starts(results: ResultsFolder, cfgs: list[RunConfig]) -> list[str]:
    """A progress line for each cold start that this machine's cache lacks and the folder holds a recipe of."""
    lines = []
    for cfg in cfgs:
        key, root = cache_key(cfg), cache_root(cfg)
        recipe = None if (root / key).is_dir() else read_recipe(results, key)
        if recipe is not None:
            lines.append(remaking_line(results.coldstart_recipe(key), recipe, f"not in the cache {root}"))
    return lines


def after_cold_starts(results: ResultsFolder, cfgs: list[RunConfig]) -> list[str]:
    """Write the recipe of each cold start the folder has none of; compare the others' digests. Returns a note for
    each made on another processor; raises a ConfigError for other weights on the recorded processor (the runs
    started now would begin from another model than the folder's finished ones)."""
    notes = []
    for cfg in cfgs:
        key = cache_key(cfg)
        if not (cache_root(cfg) / key / META_FILE).is_file():
            # a backend whose nodes warm into a cache this machine does not see (or one that trains nothing):
            # no weights here to write a recipe from or to compare
            notes.append(f"moe-lab: note: cold start {key[:12]}: not in the cache {cache_root(cfg)} after the runs; "
                         f"no recipe written or compared")
            continue
        recipe = read_recipe(results, key)
        if recipe is None:
            write_recipe(results, cfg)
            continue
        state, text = compare(recipe, weights_digest(cache_root(cfg) / key))
        if state == DIFFERS:
            raise ConfigError(f"{results.coldstart_recipe(key)}: {text}: the runs started now would begin from other "
                              f"weights than this folder's; run on the code and packages of the recipe, or choose "
                              f"another --out")
        if state == OTHER_PROCESSOR:
            notes.append(f"moe-lab: note: {text}: the runs started now begin from another model")
    return notes
