"""docs/extending.md's "A new trace layout", done: the recipe's code blocks applied to a copy of the package at the
places the page names, a dump written in the new layout, and `moe-lab check-trace --format toy` (run from the
copy, in a fresh interpreter) reading it back to the same routes and finding them the model's own."""

from __future__ import annotations

import textwrap
from pathlib import Path

from recipes import block, copy_package, insert, run_python, write_new_file

TESTS = Path(__file__).resolve().parent

LAYOUT_CHECK = textwrap.dedent("""
    import contextlib, io, sys
    from pathlib import Path
    copy, tests, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    sys.path.insert(1, tests)  # after the copy: the tests' helpers, moe_lab from the copy
    import moe_lab
    assert moe_lab.__file__.startswith(copy), moe_lab.__file__  # the copy, not the checkout
    from moe_lab.cli import main
    from moe_lab.formats.jsonl import read_input
    from moe_lab.formats.names import FORMATS
    from trace_dumps import generate_routes, load, tiny_checkpoint
    from trace_writers import encode, write_line

    assert "toy" in FORMATS  # the command line's --format choices
    ckpt = tiny_checkpoint(work / "ckpt")  # 3 decoder layers, the first dense: MoE layers 1 and 2
    model, config = load(ckpt)
    seqs = generate_routes(model, [[5, 9, 11, 3], [7, 4, 20]], new_tokens=6)

    def dump(name, first):
        lines = []
        for s in seqs:
            ids = encode(s.routes, config, layers="moe", missing=0, start=first, stop=s.num_tokens - 1)
            lines.append(write_line(s, {"routed_experts": {"ids": ids.tolist(), "first": first}}))
        (work / name).write_text("".join(line + "\\n" for line in lines))
        return work / name

    whole, late = dump("toy.jsonl", 0), dump("toy_late.jsonl", 2)
    for path, first in ((whole, 0), (late, 2)):
        back = read_input(path, config, "toy")
        assert len(back) == len(seqs)
        for b, s in zip(back, seqs):
            want_ids, want_mask = s.routes.ids_LSK.clone(), s.routes.mask_LS.clone()
            want_ids[:, :first], want_mask[:, :first] = -1, False  # positions before "first" carry no route
            assert b.routes.layout == "toy" and b.routes.layer_kind == "moe"
            assert b.tokens.tolist() == s.tokens.tolist() and b.prompt_len == s.prompt_len
            assert b.routes.mask_LS.equal(want_mask) and b.routes.ids_LSK.equal(want_ids)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = main(["check-trace", str(whole), "--model", str(ckpt), "--format", "toy"])
    out = report.getvalue().strip().splitlines()
    assert code == 0, report.getvalue()
    assert "layout toy, layer axis moe" in out[0] and out[-1] == "agreement 1.0000", report.getvalue()
    print("ok")
""")


def test_a_new_trace_layout_as_docs_extending_says(tmp_path):
    pkg = copy_package(tmp_path / "copy")
    write_new_file(pkg.parent, "layout-module")
    insert(pkg / "formats" / "names.py", '    "verl",\n', block("layout-name"), before=False)
    insert(pkg / "formats" / "layers.py", '    "verl": None,\n', block("layout-axes"), before=False)
    insert(pkg / "formats" / "jsonl.py", "from moe_lab.formats import nemo_rl, prime_rl\n", block("layout-import"),
            before=False)
    insert(pkg / "formats" / "jsonl.py", '    "verl": _read_verl,\n', block("layout-reader"), before=False)
    (tmp_path / "work").mkdir()
    done = run_python(tmp_path / "copy", ["-c", LAYOUT_CHECK, str(pkg), str(TESTS), str(tmp_path / "work")])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
