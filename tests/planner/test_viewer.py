"""The HTML/SVG plan viewer: well-formed markup that names and colours every segment, for the
paper's Appendix A trees and for a whole step plan."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from min_call_oracle import APPENDIX_A, batch_from_trajectories, case_tree, preorder, tree_batch

from harts_planner import InvalidArgumentError, Planner, RolloutBatch, plan_calls, plan_step, synth, viewer

SVG = "{http://www.w3.org/2000/svg}"
XHTML = "{http://www.w3.org/1999/xhtml}"


def _segments(root: ET.Element) -> dict[str, ET.Element]:
    return {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("class") == "seg"}


@pytest.mark.parametrize("key", ["I", "II", "III"])
def test_appendix_a_tree_renders_and_names_every_segment(key):
    case = APPENDIX_A[key]
    names, parent, lengths, extra = case_tree(case)
    batch = batch_from_trajectories(tree_batch(parent, lengths, extra)[0])
    plan = plan_calls(batch, chunk_size=64)
    labels = [names[v] for v in preorder(parent)]
    page = viewer.render_call_plan(plan, title=f"Appendix A, case {key}", names=labels)
    root = ET.fromstring(page)  # well-formed (XHTML-compatible) or this raises
    assert (
        root.tag == f"{XHTML}html"
        and "<script" not in page
        and "http" not in page.replace("http://www.w3.org/", "")
    )  # self-contained: no scripts, no external resources
    segs = _segments(root)
    assert len(segs) == plan.num_segments == len(names)
    for v in range(plan.num_segments):
        g = segs[f"mb0-s{v}"]
        texts = {t.get("class"): t.text for t in g.iter(f"{SVG}text")}
        assert texts["name"] == labels[v]
        assert texts["tokens"] == str(int(plan.segment_end[v] - plan.segment_start[v]))
        r = int(plan.sequence_round[plan.segment_sequence[v]])
        assert g.get("data-round") == str(r)
        assert g.find(f"{SVG}circle").get("fill") == viewer.PALETTE[r]
        assert labels[v] in g.find(f"{SVG}title").text
    # One dashed, labelled edge per sequence head with a parent; the labels are the replay lengths.
    replay_labels = sorted(int(t.text[2:]) for t in root.iter(f"{SVG}text") if t.get("class") == "replay")
    heads = [int(plan.chain(q)[0]) for q in range(plan.num_sequences)]
    assert replay_labels == sorted(
        int(plan.sequence_replay_length[q]) for q, h in enumerate(heads) if plan.segment_parent[h] >= 0
    )
    assert (
        f"{case['calls']}" in page
        and f"Call {case['calls']}:" in page
        and f"Call {case['calls'] + 1}:" not in page
    )


def test_step_plan_page_lays_out_microbatches_by_replica_and_slot():
    syn = synth.generate("small", seed=4)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    plan = Planner().plan_step(batch, 2, int(batch.lengths.max()) + 1000, call_plans=True)
    root = ET.fromstring(viewer.render_step_plan(plan, title="small"))
    cells = {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("class") == "mb"}
    assert len(cells) == plan.num_microbatches
    for m in range(plan.num_microbatches):
        tip = cells[f"cell-mb{m}"].find(f"{SVG}title").text
        assert f"replica {int(plan.replica[m])}, slot {int(plan.slot[m])}" in tip
        assert f"compact work {int(plan.work[m]):,}" in tip
    segs = _segments(root)
    assert len(segs) == sum(c.num_segments for c in plan.call_plans())
    for m, c in enumerate(plan.call_plans()):
        assert all(f"mb{m}-s{v}" in segs for v in range(c.num_segments))
    details = [d for d in root.iter(f"{XHTML}details")]
    assert [d.get("id") for d in details] == [f"mb{m}" for m in range(plan.num_microbatches)]


def test_render_rejects_wrong_names_and_types():
    batch = RolloutBatch.from_token_lists([[1, 2], [1, 3]])
    plan = plan_calls(batch, 4)
    step = plan_step(batch, 1, 8)
    with pytest.raises(InvalidArgumentError, match="names: needs one name per segment") as e:
        viewer.render_call_plan(plan, names=["a"])
    assert e.value.field == "names"
    for call, field in (
        (lambda: viewer.render(object()), "plan"),
        (lambda: viewer.render_call_plan("plan"), "plan"),
        (lambda: viewer.render_step_plan(plan), "step"),
        (lambda: viewer.render_step_plan(step, max_segments=-1), "max_segments"),
        (lambda: viewer.render_step_plan(step, open_trees=1.5), "open_trees"),
    ):
        with pytest.raises(InvalidArgumentError) as e:
            call()
        assert e.value.field == field
    assert "<svg" in viewer.render(plan)
