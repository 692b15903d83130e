"""to_verl / from_verl: Dew sessions as verl agent-loop rows and back, exactly; verl's own rows
(no Dew fields) imported as one call per run of sampled ids; what is refused."""

import json
from pathlib import Path

import numpy as np
import pytest

from dew_lib.records.sessions import Call, Session, Status
from dew_lib.rollouts import pack
from dew_lib.rollouts.verl import VerlTrajectory, from_verl, to_verl

LAYERS, TOP_K = 2, 2


def routing(length, seed):
    return np.random.default_rng(seed).integers(0, 8, (length, LAYERS, TOP_K)).astype(np.int16)


def call(prompt, sampled, version, *, routed=None, **fields):
    rng = np.random.default_rng(len(prompt) + 7 * version)
    return Call(prompt_ids=np.array(prompt, np.int32), sampled_ids=np.array(sampled, np.int32),
                behavior_log_probs=-rng.random(len(sampled)).astype(np.float32), version=version,
                routed_experts=routed, **fields)


def tool_session():
    """Three turns: turn 1 extends turn 0 through a tool answer; turn 2 starts over (a new
    chain); turn 1's routing extends turn 0's, as an engine's prefill of the same ids gives."""
    full = routing(12, 1)
    first = call([5, 6, 7], [8, 9, 2], 3, routed=full[:6], raw_log_probs=[-0.1, -0.2, -0.3],
                 support=(np.array([8, 4]), np.array([9]), np.array([2, 3])))
    second = call([5, 6, 7, 8, 9, 2, 11, 12], [13, 2], 4, routed=full[:10], finish_reason="stop")
    restart = routing(4, 2)
    third = call([5, 14], [15], 4, routed=restart[:3], finish_reason="length")
    empty = call([5, 14, 15, 16], [], 5, routed=restart, finish_reason="abort")
    return Session(task="gsm8k/7", group=2, sample=1, attempt=1, calls=(first, second, third, empty),
                   status=Status.TRUNCATED, reward=0.5, components={"format": 1.0}, detail="turn budget")


def same_calls(a: Session, b: Session):
    assert (a.task, a.group, a.sample, a.attempt, a.status, a.reward, dict(a.components), a.detail) == \
           (b.task, b.group, b.sample, b.attempt, b.status, b.reward, dict(b.components), b.detail)
    assert len(a.calls) == len(b.calls)
    for x, y in zip(a.calls, b.calls, strict=True):
        for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "raw_log_probs", "routed_experts"):
            left, right = getattr(x, name), getattr(y, name)
            assert (left is None) == (right is None), name
            if left is not None:
                np.testing.assert_array_equal(left, right, err_msg=name)
        assert (x.finish_reason, x.version) == (y.finish_reason, y.version)
        assert (x.support is None) == (y.support is None)
        if x.support is not None:
            assert [s.tolist() for s in x.support] == [s.tolist() for s in y.support]


def test_a_session_is_one_row_per_strict_chain_with_masks_versions_and_routing():
    rows = to_verl([tool_session()])
    assert len(rows) == 2  # turns 0-1 chain; turn 2 and the empty call start another
    first, second = rows
    assert first["prompt_ids"] == [5, 6, 7]
    assert first["response_ids"] == [8, 9, 2, 11, 12, 13, 2]
    assert first["response_mask"] == [1, 1, 1, 0, 0, 1, 1]
    session = tool_session()
    expected = [*session.calls[0].behavior_log_probs, 0.0, 0.0, *session.calls[1].behavior_log_probs]
    np.testing.assert_allclose(first["response_logprobs"], expected)
    assert first["routed_experts"].shape == (10, LAYERS, TOP_K)
    assert (first["extra_fields"]["min_global_steps"], first["extra_fields"]["max_global_steps"]) == (3, 4)
    assert (second["extra_fields"]["min_global_steps"], second["extra_fields"]["max_global_steps"]) == (4, 5)
    assert second["response_mask"] == [1, 0] and first["reward_score"] == 0.5 and first["num_turns"] == 4


def test_rows_dew_wrote_come_back_as_the_same_sessions():
    sessions = [tool_session(), Session(task="3", calls=(call([1, 2], [3, 4], 0),), reward=1.0)]
    back = from_verl(to_verl(sessions))
    assert [type(t) for t in back] == [VerlTrajectory, VerlTrajectory]
    for original, trajectory in zip(sessions, back, strict=True):
        same_calls(original, trajectory.session)


def test_verl_rows_become_one_call_per_run_of_sampled_ids_grouped_by_rollout_n():
    rows = [{"prompt_ids": [1, 2], "response_ids": [3, 4, 9, 9, 5], "response_mask": [1, 1, 0, 0, 1],
             "response_logprobs": [-0.5, -0.25, 0.0, 0.0, -1.0], "reward_score": float(i),
             "routed_experts": routing(7, i).tolist(), "num_turns": 4,
             "metrics": {"generate_sequences": 1.5}, "extra_fields": {"min_global_steps": 6, "max_global_steps": 7,
                                                                     "turn_scores": [0.0, float(i)]}}
            for i in range(4)]
    trajectories = from_verl(rows, samples=2)
    assert [(t.session.task, t.session.group, t.session.sample) for t in trajectories] == \
           [("0", 0, 0), ("0", 0, 1), ("1", 1, 0), ("1", 1, 1)]
    first = trajectories[0].session
    assert [c.prompt_ids.tolist() for c in first.calls] == [[1, 2], [1, 2, 3, 4, 9, 9]]
    assert [c.sampled_ids.tolist() for c in first.calls] == [[3, 4], [5]]
    assert [c.version for c in first.calls] == [6, 6] and first.calls[1].routed_experts.shape == (7, 2, 2)
    # verl's own extra fields (and its versions) go back out unchanged
    out = to_verl(trajectories)
    assert [r["extra_fields"]["turn_scores"] for r in out] == [r["extra_fields"]["turn_scores"] for r in rows]
    assert all((r["extra_fields"]["min_global_steps"], r["extra_fields"]["max_global_steps"]) == (6, 7) for r in out)
    assert [r["response_ids"] for r in out] == [r["response_ids"] for r in rows]
    np.testing.assert_array_equal(out[0]["routed_experts"], np.asarray(rows[0]["routed_experts"]))


def test_packing_imported_rows_matches_verls_tensor_layout():
    """verl trains `prompts + responses` with the response mask on the response part; packed
    rows of the imported session hold the same ids with the same mask and log-probabilities."""
    row = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 8, 8, 6, 7], "response_mask": [1, 1, 0, 0, 1, 1],
           "response_logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4], "reward_score": 1.0,
           "extra_fields": {"min_global_steps": 0}}
    (trajectory,) = from_verl([row])
    packed = pack([trajectory.session], width=12, rows=1)
    length = 9
    assert packed["input_ids"][0, :length].tolist() == row["prompt_ids"] + row["response_ids"]
    assert packed["response_mask"][0, :length].tolist() == [0, 0, 0] + row["response_mask"]
    np.testing.assert_allclose(packed["behavior_log_probs"][0, :length], [0, 0, 0] + row["response_logprobs"],
                               atol=1e-7)


@pytest.mark.parametrize("change, message", [
    ({"response_logprobs": None}, "response_logprobs"),
    ({"extra_fields": {}}, "min_global_steps"),
    ({"reward_score": None}, "reward_score"),
    ({"multi_modal_data": {"image": ["x"]}}, "media"),
    ({"response_mask": [1]}, "differ in length"),
])
def test_rows_that_cannot_train_are_refused(change, message):
    row = {"prompt_ids": [1], "response_ids": [2, 3], "response_mask": [1, 1], "response_logprobs": [-0.1, -0.2],
           "reward_score": 1.0, "extra_fields": {"min_global_steps": 0}}
    with pytest.raises(ValueError, match=message):
        from_verl([{**row, **change}])


def test_imported_calls_pass_the_checks_live_actions_pass():
    """With the policy's EOS ids, a native row's runs end "stop" on EOS and "length" otherwise,
    and ids past an EOS are refused, in verl's rows and in rows Dew wrote alike."""
    eos = 2
    row = {"prompt_ids": [1], "response_ids": [3, 2, 9, 4], "response_mask": [1, 1, 0, 1],
           "response_logprobs": [-0.1, -0.2, 0.0, -0.3], "reward_score": 1.0,
           "extra_fields": {"min_global_steps": 0}}
    (trajectory,) = from_verl([row], eos_ids=[eos])
    assert [c.finish_reason for c in trajectory.session.calls] == ["stop", "length"]
    with pytest.raises(ValueError, match="verl row 0, call 0 has 1 ids after EOS 2"):
        from_verl([{**row, "response_ids": [2, 3, 9, 4]}], eos_ids=[eos])
    written = to_verl([Session(task="t", calls=(call([1], [3, 2, 5], 0, finish_reason="length"),), reward=1.0)])
    assert len(from_verl(written)) == 1  # without EOS ids nothing is checked
    with pytest.raises(ValueError, match=r"call 0 has 1 ids after EOS 2"):
        from_verl(written, eos_ids=[eos])
    said_stop = to_verl([Session(task="t", calls=(call([1], [3, 5], 0, finish_reason="stop"),), reward=1.0)])
    with pytest.raises(ValueError, match="says EOS ended it"):
        from_verl(said_stop, eos_ids=[eos])


def test_media_rows_pass_through_only_when_asked():
    row = {"prompt_ids": [1], "response_ids": [2], "response_mask": [1], "response_logprobs": [-0.1],
           "reward_score": 1.0, "extra_fields": {"min_global_steps": 0}, "multi_modal_data": {"image": ["x"]}}
    (trajectory,) = from_verl([row], media=True)
    assert trajectory.session.calls[0].sampled_ids.tolist() == [2]
    with pytest.raises(ValueError, match="rollout.n"):
        from_verl([row], samples=0, media=True)


REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "verl" / "interop.json").read_text())


def test_verls_own_rows_import_and_go_back_out_unchanged():
    rows = REFERENCE["agent_loop_rows"]
    trajectories = from_verl(rows, samples=2)
    assert [(t.session.group, t.session.sample, len(t.session.calls)) for t in trajectories] == \
           [(0, 0, 2), (0, 1, 1), (1, 0, 2), (1, 1, 1)]
    out = to_verl(trajectories)
    for mine, theirs in zip(out, rows, strict=True):
        assert set(mine) <= set(REFERENCE["reference"]["fields"])  # only AgentLoopOutput's fields
        for field in ("prompt_ids", "response_ids", "response_mask", "reward_score", "num_turns"):
            assert mine[field] == theirs[field], field
        # Dew keeps likelihoods as float32, as engines report them
        np.testing.assert_array_equal(np.float32(mine["response_logprobs"]), np.float32(theirs["response_logprobs"]))
        np.testing.assert_array_equal(mine["routed_experts"], np.asarray(theirs["routed_experts"]))
        assert {k: v for k, v in mine["extra_fields"].items() if k != "dew"} == theirs["extra_fields"]
    # and they pack as verl lays them out: prompt then response, the mask on the response
    packed = pack([trajectories[0].session], width=40, rows=1)
    ids = rows[0]["prompt_ids"] + rows[0]["response_ids"]
    assert packed["input_ids"][0, :len(ids)].tolist() == ids
    assert packed["response_mask"][0, :len(ids)].tolist() == [0] * len(rows[0]["prompt_ids"]) + rows[0]["response_mask"]
    assert packed["routed"][0, :len(ids)].all()


def test_verls_gsm8k_tool_agent_parquet_reads_as_prompts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dew_lib.data import Prompts
    from dew_lib.data.dataset import Partition
    from dew_lib.data.prompts import text_field

    rows = REFERENCE["gsm8k_rows"]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tokenizer = Path(__file__).parent / "fixtures" / "hf" / "qwen3"
    spec = Prompts(path=str(path), max_prompt_len=256, tokenizer=str(tokenizer))
    batch = next(spec.load(batch=2).stream(Partition()))
    assert text_field(batch["ground_truth"]) == [r["reward_model"]["ground_truth"] for r in rows]
    extra = [json.loads(text) for text in text_field(batch["extra_info"])]
    assert [e["tools_kwargs"] for e in extra] == [r["extra_info"]["tools_kwargs"] for r in rows]
    assert text_field(batch["data_source"]) == ["openai/gsm8k"] * 2
