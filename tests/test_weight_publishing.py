"""Publishing weights to remote engines: SafetensorsReload (vLLM, SGLang), Publication, the
gateway's stamp and readiness, and NCCLPush's request sequence and library refusals.

Everything runs against the stand-ins of tests/standin_weights.py on 127.0.0.1. A reload is read
back from disk with load_pretrained, as the replica would serve it; NCCLPush sends through a
loopback communicator in place of NCCL (the real broadcast needs GPUs and a running vLLM, and is
not exercised here).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import tiny_model
from standin_completions import app, serve
from standin_weights import (
    GatewayState,
    Journal,
    Loopback,
    LoopbackCommunicator,
    Replica,
    gateway_router,
    sglang_router,
    vllm_router,
)

from dew_lib.data.dataset import Dataset, Partition
from dew_lib.inference.base import push_weights
from dew_lib.inference.endpoints import EndpointFailed, PushFailed
from dew_lib.inference.gateway import Gateway, GatewayNotReady
from dew_lib.inference.nccl import NCCLError, NCCLLibrary, NCCLPush
from dew_lib.inference.publish import Publication, SafetensorsReload
from dew_lib.models.pretrained import Pretrained

VLLM_PUSH = ["POST /pause?mode=wait", "POST /collective_rpc", "POST /reset_prefix_cache",
             "POST /update_weight_version", "POST /resume"]
NCCL_OPEN = ["GET /get_world_size?include_dp=true", "POST /init_weight_transfer_engine"]
NCCL_PUSH = ["POST /pause?mode=wait", "POST /start_weight_update", "POST /update_weights",
             "POST /finish_weight_update", "POST /reset_prefix_cache", "POST /resume"]


@pytest.fixture(scope="module")
def policy():
    """A tiny Qwen3-style decoder as a Pretrained, and three distinct sets of its variables."""
    model = tiny_model(num_layers=1)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    versions = [jax.tree.map(lambda x, k=k: x * (k + 1) + 0.01 * k, variables) for k in range(3)]
    return Pretrained.from_model(model), versions


def bf16_leaves(variables):
    return {jax.tree_util.keystr(path): np.asarray(leaf).astype(ml_dtypes.bfloat16)
            for path, leaf in jax.tree_util.tree_leaves_with_path(variables)}


def assert_serves(replica, variables):
    """The replica's reloaded checkpoint equals `variables` cast to bfloat16, leaf for leaf."""
    got, want = bf16_leaves(replica.reloaded), bf16_leaves(variables)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@contextlib.contextmanager
def engines(journal, count, *, router=vllm_router, directory=None, loopback=None):
    """`count` stand-in replicas named a, b, ..., each served on its own port: (replicas, urls)."""
    with contextlib.ExitStack() as stack:
        replicas = [Replica(name, journal, directory=directory, loopback=loopback) for name in "abcd"[:count]]
        urls = [stack.enter_context(serve(app(router(replica)))) for replica in replicas]
        yield replicas, urls


@contextlib.contextmanager
def gateway(journal, **options):
    state = GatewayState("gateway", journal, **options)
    with serve(app(gateway_router(state))) as url:
        yield state, url


# ----- SafetensorsReload --------------------------------------------------------------------------

def test_vllm_reload_runs_the_sequence_on_both_replicas_at_once_and_serves_the_pushed_weights(policy, tmp_path):
    pretrained, versions = policy
    journal = Journal()
    with engines(journal, 2, directory=tmp_path / "policy") as ((a, b), urls):
        reload = SafetensorsReload(pretrained, tmp_path / "policy", urls, "vllm", timeout=10)
        reload.write(versions[0])  # the launch directory
        publication = Publication(reload, version=0)
        a.fail("/reset_prefix_cache", "timeout", delay=0.5)  # a slow reset on a, answered in time
        push_weights(publication, versions[1], 1)
    for replica in (a, b):
        assert journal.endpoints(replica.name) == VLLM_PUSH
        calls = journal.of(replica.name)
        assert calls[1].body == {"method": "reload_weights"}
        assert calls[3].body == {"new_version": "1"}
        assert replica.version == "1" and not replica.paused and replica.loads == 1
        assert_serves(replica, versions[1])
    # Concurrent, not one replica after the other: b finished while a was still in its reset.
    assert journal.index("b", "POST /resume")[0] < journal.index("a", "POST /resume")[0]
    assert publication.version == 1


def test_sglang_reload_is_one_call_naming_the_directory_and_version(policy, tmp_path):
    pretrained, versions = policy
    journal = Journal()
    with engines(journal, 2, router=sglang_router, directory=tmp_path / "policy") as (replicas, urls):
        reload = SafetensorsReload(pretrained, tmp_path / "policy", urls, "sglang", timeout=10)
        reload.write(versions[0])
        reload(versions[2], 4)
    for replica in replicas:
        assert [(c.endpoint, c.body) for c in journal.of(replica.name)] == [(
            "POST /update_weights_from_disk",
            {"model_path": str(tmp_path / "policy"), "flush_cache": True, "abort_all_requests": False,
             "weight_version": "4"})]
        assert replica.version == "4"
        assert_serves(replica, versions[2])


@pytest.mark.parametrize("engine, path, kind, status, shown", [
    ("vllm", "/collective_rpc", "status", 500, "answered 500"),
    ("vllm", "/reset_prefix_cache", "unsuccessful", 200, '"success":false'),
    ("sglang", "/update_weights_from_disk", "status", 400, "answered 400"),
    ("sglang", "/update_weights_from_disk", "unsuccessful", 200, '"success":false'),
])
def test_a_refused_reload_fails_the_push_naming_replica_endpoint_and_answer(policy, tmp_path, engine, path,
                                                                            kind, status, shown):
    pretrained, versions = policy
    journal = Journal()
    router = vllm_router if engine == "vllm" else sglang_router
    with engines(journal, 2, router=router, directory=tmp_path / "policy") as ((a, b), urls):
        reload = SafetensorsReload(pretrained, tmp_path / "policy", urls, engine, timeout=10)
        reload.write(versions[0])
        publication = Publication(reload, version=0)
        b.fail(path, kind, status=status)
        with pytest.raises(PushFailed) as raised:
            publication.load(versions[1], 1)
    message = str(raised.value)
    assert "failed on 1 of 2 replicas" in message and urls[1] in message and urls[0] not in message
    assert f"POST {path}" in message and shown.replace(" ", "") in message.replace(" ", "")
    assert [f.server for f in raised.value.failures] == [urls[1]]
    assert publication.version == 0 and b.version is None


def test_a_replica_that_failed_after_its_pause_stays_paused_until_the_next_push_succeeds(policy, tmp_path):
    pretrained, versions = policy
    journal = Journal()
    with engines(journal, 2, directory=tmp_path / "policy") as ((a, b), urls):
        reload = SafetensorsReload(pretrained, tmp_path / "policy", urls, timeout=10)
        reload.write(versions[0])
        publication = Publication(reload, version=0)
        b.fail("/reset_prefix_cache", "unsuccessful")
        with pytest.raises(PushFailed, match="reset_prefix_cache"):
            publication.load(versions[1], 1)
        assert b.paused and not a.paused and "POST /resume" not in journal.endpoints("b")
        assert publication.version == 0
        publication.load(versions[2], 2)
    assert not b.paused and b.version == "2" and publication.version == 2
    assert journal.endpoints("b") == VLLM_PUSH[:3] + VLLM_PUSH
    assert_serves(b, versions[2])


@pytest.mark.parametrize("kind, shown", [
    ("timeout", "gave no answer within the timeout"),
    ("malformed", "answered 200 with a body that is not JSON: {not json"),
    ("drop", "gave no answer (RemoteProtocolError"),
])
def test_no_usable_answer_fails_the_push(policy, tmp_path, kind, shown):
    pretrained, versions = policy
    journal = Journal()
    with engines(journal, 1, directory=tmp_path / "policy") as ((a,), urls):
        reload = SafetensorsReload(pretrained, tmp_path / "policy", urls, timeout=0.5)
        reload.write(versions[0])
        a.fail("/update_weight_version", kind, delay=1.0)
        with pytest.raises(PushFailed) as raised:
            reload(versions[1], 1)
    assert f"{urls[0]}: POST /update_weight_version {shown}" in str(raised.value)
    assert a.paused  # the failure came after the pause


def test_reload_options_are_checked(policy, tmp_path):
    pretrained, _ = policy
    with pytest.raises(ValueError, match="engine='tgi' is not supported"):
        SafetensorsReload(pretrained, tmp_path, ["http://127.0.0.1:1"], "tgi")
    with pytest.raises(ValueError, match="ends in /v1; pass the server's root URL"):
        SafetensorsReload(pretrained, tmp_path, ["http://127.0.0.1:1/v1"])
    with pytest.raises(ValueError, match="lists a replica twice"):
        SafetensorsReload(pretrained, tmp_path, ["http://127.0.0.1:1", "http://127.0.0.1:1/"])
    with pytest.raises(ValueError, match="nonempty list"):
        SafetensorsReload(pretrained, tmp_path, "http://127.0.0.1:1")


def test_dev_endpoints_are_absent_without_dev_mode(policy, tmp_path):
    pretrained, versions = policy
    replica = Replica("a", Journal(), directory=tmp_path / "policy")
    with serve(app(vllm_router(replica, dev_mode=False))) as url:
        reload = SafetensorsReload(pretrained, tmp_path / "policy", [url], timeout=10)
        reload.write(versions[0])
        with pytest.raises(PushFailed, match=r"POST /pause\?mode=wait answered 404"):
            reload(versions[1], 1)


# ----- Publication and the gateway -------------------------------------------------------------

def test_the_gateway_is_stamped_only_after_every_replica_serves_the_version(policy, tmp_path):
    pretrained, versions = policy
    journal = Journal()
    with engines(journal, 2, directory=tmp_path / "policy") as ((a, b), urls), gateway(journal) as (state, url):
        state.weight_version = 9  # left behind by an earlier run
        reload = SafetensorsReload(pretrained, tmp_path / "policy", urls, timeout=10)
        reload.write(versions[0])
        publication = Publication(reload, version=0, stamp=Gateway(url).stamp)
        assert state.weight_version == 0  # construction stamps the launch version
        b.fail("/collective_rpc", "timeout", delay=0.5)  # b is the last to finish
        publication.load(versions[1], 1)
        stamps = journal.index("gateway", "POST /admin/weight_version")
        assert len(stamps) == 2 and state.weight_version == 1
        assert stamps[1] > max(journal.index("a", "POST /resume") + journal.index("b", "POST /resume"))
        assert journal.of("gateway")[-1].body == {"weight_version": 1}

        b.fail("/update_weight_version", "status", status=500)
        with pytest.raises(PushFailed):
            publication.load(versions[2], 2)
        assert len(journal.index("gateway", "POST /admin/weight_version")) == 2  # no stamp for 2
        assert state.weight_version == 1 and publication.version == 1


def test_a_failed_stamp_leaves_the_version(policy):
    _, versions = policy
    pushed = []
    journal = Journal()
    with gateway(journal) as (state, url):
        publication = Publication(lambda variables, version: pushed.append(version), version=3,
                                  stamp=Gateway(url).stamp)
        state.fail("/admin/weight_version", "status", status=400)
        with pytest.raises(EndpointFailed, match="POST /admin/weight_version answered 400"):
            publication.load(versions[1], 4)
        assert pushed == [4] and publication.version == 3 and state.weight_version == 3
        publication.load(versions[1], np.int64(5))  # a numpy step count serializes as a plain int
    assert publication.version == 5 and type(publication.version) is int and state.weight_version == 5


def test_publication_refuses_what_is_not_a_push():
    with pytest.raises(ValueError, match="push must be callable"):
        Publication("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="version must be an int"):
        Publication(lambda v, n: None, version="0")


def test_gateway_ready_waits_for_a_healthy_worker_and_models():
    journal = Journal()
    with gateway(journal, healthy=False) as (state, url):
        threading.Timer(0.6, lambda: state.healthy.__setitem__(0, True)).start()
        Gateway(url, ready_timeout=10).ready()
        assert "GET /v1/models" in journal.endpoints("gateway")
        state.healthy[0] = False
        with pytest.raises(GatewayNotReady, match=r"no healthy worker \(GET /health/workers answered .*'healthy': 0"):
            Gateway(url, ready_timeout=0.6).ready()
        state.healthy[0] = True
        state.fail("/v1/models", "status", status=503, times=100)
        with pytest.raises(GatewayNotReady, match="no answer to /v1/models through the gateway .*answered 503"):
            Gateway(url, ready_timeout=0.6).ready()


def test_gateway_options_are_checked():
    with pytest.raises(ValueError, match="sandbox_url='http://10.0.0.1:9090/' is the gateway's own address"):
        Gateway("http://10.0.0.1:9090", sandbox_url="http://10.0.0.1:9090/")
    with pytest.raises(ValueError, match="ends in /v1"):
        Gateway("http://10.0.0.1:9090/v1")
    assert Gateway("http://10.0.0.1:9090/", sandbox_url="http://10.0.0.1:9091").url == "http://10.0.0.1:9090"


# ----- the scheduler as the publisher's caller ---------------------------------------------------

class _InstantSource:
    """A SessionSource whose every rollout completes at once with reward 1."""

    def __init__(self):
        from dew_lib.records import Call, Session

        self._session = lambda: Session(task="t", calls=(Call(prompt_ids=[1, 2], sampled_ids=[3, 4],
                                                               behavior_log_probs=[-1.0, -1.0], version=0,
                                                               finish_reason="stop"),), reward=1.0)

    def submit(self, task, *, group, sample, attempt, seed):
        from concurrent.futures import Future

        future = Future()
        future.set_result(self._session())
        return future

    def cancel(self, future):
        pass


def test_the_scheduler_publishes_through_a_publication(policy, tmp_path):
    from dew_lib import models
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import RolloutScheduler

    pretrained, versions = policy
    journal = Journal()
    width = 12
    objective = GRPOObjective(models.build("causal_transformer", vocab_size=16, emb_features=8, num_layers=1,
                                           num_heads=1, mlp_features=8, max_seq_len=width),
                              width - 1, behavior_importance=2.0)
    with engines(journal, 1, directory=tmp_path / "policy") as ((a,), urls):
        reload = SafetensorsReload(pretrained, tmp_path / "policy", urls, timeout=10)
        reload.write(versions[0])
        publication = Publication(reload, version=0)
        scheduler = RolloutScheduler(objective, _InstantSource(), publication, width=width, rows=8, groups=2)
        data = [{"task_id": np.array([i], np.int64)} for i in range(3)]
        stream = scheduler.tasks(Dataset(train=lambda partition: iter(data), batch=1)).stream(Partition(), 0)
        key = np.array([0, 7], np.uint32)
        for updates in range(2):
            state = types.SimpleNamespace(params=versions[updates + 1]["params"], updates=np.int32(updates))
            scheduler(state, next(stream), key)
        scheduler.close()
    assert publication.version == 1 and a.version == "1" and a.loads == 2
    assert_serves(a, versions[2])


# ----- NCCLPush -----------------------------------------------------------------------------------

def exported(pretrained, variables):
    return {name: np.asarray(array) for name, array in pretrained.export(variables)}


def test_nccl_push_opens_groups_once_and_runs_the_sequence_on_two_replicas(policy):
    pretrained, versions = policy
    journal, loopback = Journal(), Loopback(timeout=5)
    communicator = LoopbackCommunicator(loopback)
    with engines(journal, 2, loopback=loopback) as ((a, b), urls):
        push = NCCLPush(pretrained, urls, communicator=communicator, chunk_bytes=1024, timeout=10)
        publication = Publication(push, version=0)
        push_weights(publication, versions[1], 1)
        for replica in (a, b):
            assert replica.received.keys() == exported(pretrained, versions[1]).keys()
        push_weights(publication, versions[2], 2)
        publication.close()
    tensors = pretrained.tensors
    for replica in (a, b):
        assert journal.endpoints(replica.name) == NCCL_OPEN + NCCL_PUSH + NCCL_PUSH
        calls = journal.of(replica.name)
        init = calls[1].body["init_info"]
        assert {k: init[k] for k in ("rank_offset", "world_size", "packed")} == \
            {"rank_offset": 1, "world_size": 2, "packed": False}
        assert calls[4].body == {"update_info": {"names": [t.name for t in tensors],
                                                 "dtype_names": ["bfloat16"] * len(tensors),
                                                 "shapes": [list(t.shape) for t in tensors]}}
        assert calls[5].body == {"weight_version": "1"} and calls[11].body == {"weight_version": "2"}
        assert replica.version == "2" and not replica.paused
        want = exported(pretrained, versions[2])
        for name, array in replica.received.items():
            np.testing.assert_array_equal(array, want[name], err_msg=name)
    ids = [journal.of(name)[1].body["init_info"]["nccl_unique_id_b64"] for name in "ab"]
    assert ids[0] != ids[1]  # one group per replica
    sizes = [int(np.prod(t.shape)) * 2 for t in tensors]
    assert sum(sizes) > 4 * 1024  # several chunks, so the bound below is a real one
    assert communicator.most_held == 2 and communicator.held == 0
    assert communicator.opened == 2 and communicator.aborted == 2  # closed by publication.close()
    assert len(communicator.sent) == 2 * len(tensors)


def test_nccl_push_without_the_warm_up_all_reduce_fails_to_open(policy):
    pretrained, versions = policy
    journal, loopback = Journal(), Loopback(timeout=0.5)
    communicator = LoopbackCommunicator(loopback, warm_up=False)
    with engines(journal, 1, loopback=loopback) as ((a,), urls):
        push = NCCLPush(pretrained, urls, communicator=communicator, timeout=10)
        with pytest.raises(PushFailed, match="POST /init_weight_transfer_engine answered 500"):
            push(versions[1], 1)
    assert journal.endpoints("a") == NCCL_OPEN and not a.paused


def test_a_failed_transfer_aborts_the_groups_and_the_next_push_reopens_them(policy):
    pretrained, versions = policy
    journal, loopback = Journal(), Loopback(timeout=5)
    communicator = LoopbackCommunicator(loopback)
    with engines(journal, 2, loopback=loopback) as ((a, b), urls):
        publication = Publication(NCCLPush(pretrained, urls, communicator=communicator, timeout=10), version=0)
        b.fail("/update_weights", "status", status=500)
        with pytest.raises(PushFailed, match=f"{urls[1]}: POST /update_weights answered 500"):
            publication.load(versions[1], 1)
        assert communicator.aborted == 2 and a.paused and b.paused and publication.version == 0
        publication.load(versions[2], 2)
        assert communicator.opened == 4 and not a.paused and not b.paused and publication.version == 2
        b.fail("/reset_prefix_cache", "unsuccessful")
        with pytest.raises(PushFailed, match="reset_prefix_cache"):
            publication.load(versions[1], 3)
        assert b.paused and communicator.aborted == 2  # the transfer itself went through: groups kept
        publication.close()
    assert journal.endpoints("b")[-6:] == ["POST /resume"] + NCCL_PUSH[:5]  # no resume after the failed reset
    assert journal.endpoints("a").count("POST /init_weight_transfer_engine") == 2


def test_nccl_push_checks_variables_before_touching_a_replica(policy):
    pretrained, _ = policy
    journal, loopback = Journal(), Loopback(timeout=5)
    with engines(journal, 1, loopback=loopback) as (_, urls):
        push = NCCLPush(pretrained, urls, communicator=LoopbackCommunicator(loopback), timeout=10)
        with pytest.raises(ValueError, match="missing params"):
            push({"params": {}}, 1)
    assert journal.endpoints("a") == []


FAKE_NCCL = r"""
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetVersion(int *version) { *version = VERSION; return 0; }
const char *ncclGetErrorString(int result) { return "stand-in error"; }
int ncclGetUniqueId(ncclUniqueId *id) { memset(id->internal, 7, 128); return 0; }
int ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) {
  *comm = (void *)(long)(id.internal[0] + 1000 * nranks + rank); return 0; }
int ncclAllReduce(const void *s, void *r, unsigned long n, int t, int op, void *c, void *st) { return 3; }
int ncclBroadcast(const void *s, void *r, unsigned long n, int t, int root, void *c, void *st) { return 0; }
int ncclCommAbort(void *comm) { return 0; }
"""


def fake_nccl(tmp_path, code: int):
    """A shared library with NCCL's symbols reporting version `code`; skips where no C compiler is found."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in libnccl")
    source, library = tmp_path / f"nccl{code}.c", tmp_path / f"libnccl{code}.so"
    source.write_text(FAKE_NCCL)
    subprocess.run([compiler, "-shared", "-fPIC", f"-DVERSION={code}", "-o", str(library), str(source)], check=True)
    return library


def test_the_nccl_binding_refuses_what_is_not_the_engines_nccl(policy, tmp_path):
    pretrained, _ = policy
    with pytest.raises(NCCLError, match="no NCCL library at .*missing.so.2; pass the engine's own libnccl.so.2"):
        NCCLLibrary(tmp_path / "missing.so.2")
    (tmp_path / "text.so").write_text("not a library")
    with pytest.raises(NCCLError, match="cannot load .*text.so as a shared library"):
        NCCLLibrary(tmp_path / "text.so")
    libc = next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6",
                            "/lib64/libc.so.6", "/usr/lib/libc.so.6") if __import__("os").path.isfile(p))
    with pytest.raises(NCCLError, match="is not an NCCL library: it lacks ncclGetVersion, ncclGetErrorString"):
        NCCLLibrary(libc)
    with pytest.raises(NCCLError, match="is not an NCCL library"):
        NCCLPush(pretrained, ["http://127.0.0.1:1"], libc)
    with pytest.raises(ValueError, match="exactly one of them"):
        NCCLPush(pretrained, ["http://127.0.0.1:1"])

    fake = fake_nccl(tmp_path, 22703)
    with pytest.raises(NCCLError, match="is NCCL 2.27.3 but the engine runs NCCL 2.26.2: NCCL refuses a peer"):
        NCCLLibrary(fake, expected_version="2.26.2")
    with pytest.raises(ValueError, match="nccl_version='2.27' is not a version"):
        NCCLLibrary(fake, expected_version="2.27")
    library = NCCLLibrary(fake, expected_version="2.27.3")
    assert library.version == (2, 27, 3)
    unique_id = library.unique_id()
    assert unique_id == bytes([7]) * 128
    assert library.init_rank(unique_id, 0, 2).value == 7 + 2000  # the id went by value, intact
    with pytest.raises(NCCLError, match="ncclAllReduce failed with NCCL error 3: stand-in error"):
        library.all_reduce(None, 0, 1, "float32")
    with pytest.raises(NCCLError, match="is NCCL 2.8.4; a push needs NCCL 2.10 or newer"):
        NCCLLibrary(fake_nccl(tmp_path, 2804))
