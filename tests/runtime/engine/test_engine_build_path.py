"""One floor per job: every source of a job's model (a checkpoint folder, a flavor, a ModelConfig, a
model the caller made) is built and parallelized by one path, ``engine.load.build_model`` (through
``prepare_model``, the one place ``parallelize`` is called), whether the engine is made by
``HartsEngine.build`` or by its constructor; the constructor only wires the model it gets. A fake
``parallelize`` and mesh stand in for a real mesh (the real ones: ``tests/parallel``)."""

import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, model_config
from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.engine import load as engine_load

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def counted(monkeypatch):
    """Counts of ``prepare_model`` (every source's one path) and of ``parallelize`` calls (a fake
    that marks the model parallel, as the real one does)."""
    import importlib

    par = importlib.import_module("harts_runtime.parallel.parallelize")  # the module, not the function

    counts = {"prepare": 0, "parallelize": 0}
    real_prepare = engine_load.prepare_model

    def prepare(*a, **k):
        counts["prepare"] += 1
        return real_prepare(*a, **k)

    def parallelize(model, mesh, **options):
        counts["parallelize"] += 1
        model._harts_parallel = mesh

    monkeypatch.setattr(engine_load, "prepare_model", prepare)
    monkeypatch.setattr(par, "parallelize", parallelize)
    return counts


def _folder(tmp_path):
    torch.manual_seed(0)
    HartsEngine.build("qwen3.5-tiny", num_layers=2, dtype="float32").save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_every_source_takes_the_one_path(counted, tmp_path):
    folder = _folder(tmp_path)
    counted["prepare"] = 0
    cfg = model_config("debug", dtype="float32")
    makers = [
        lambda: HartsEngine.build(folder),
        lambda: HartsEngine.build("debug"),
        lambda: HartsEngine.build(cfg),
        lambda: HartsEngine.build(HybridModel(cfg)),
        lambda: HartsEngine(HybridModel(cfg)),
        lambda: HartsEngine(cfg),
    ]
    for i, make in enumerate(makers, 1):
        engine = make()
        assert counted["prepare"] == i  # once per engine, however it was made
        assert isinstance(engine.model, HybridModel) and engine.model.training
    assert counted["parallelize"] == 0  # no mesh


def test_a_mesh_parallelizes_once_on_the_build_path(counted, tmp_path):
    mesh = object()  # the fake parallelize only records it
    cfg = model_config("debug", dtype="float32")
    engine = HartsEngine(HybridModel(cfg), EngineConfig(), mesh=mesh)
    assert counted == {"prepare": 1, "parallelize": 1} and engine.mesh is mesh
    again = HartsEngine(engine.model, EngineConfig(), mesh=mesh)  # parallel already: taken as it is
    assert counted == {"prepare": 2, "parallelize": 1} and again.model is engine.model
    HartsEngine.build(cfg, EngineConfig(), mesh=mesh)
    assert counted == {"prepare": 3, "parallelize": 2}


def test_a_config_and_the_model_of_it_make_the_same_engine():
    cfg = model_config("debug", dtype="float32")
    torch.manual_seed(3)
    a = HartsEngine(cfg)
    torch.manual_seed(3)
    b = HartsEngine.build(cfg)
    torch.manual_seed(3)
    c = HartsEngine(HybridModel(cfg))
    for (n, p), (_, q), (_, r) in zip(
        a.model.named_parameters(), b.model.named_parameters(), c.model.named_parameters()
    ):
        assert torch.equal(p, q) and torch.equal(p, r), n


def test_recompute_is_applied_on_the_build_path():
    from harts_runtime.recompute import recompute_enabled

    cfg = model_config("debug", dtype="float32")
    assert recompute_enabled(HartsEngine(cfg, EngineConfig(recompute=True)).model)
    assert recompute_enabled(HartsEngine.build(cfg, EngineConfig(recompute=True)).model)
    assert not recompute_enabled(HartsEngine(cfg).model)


@pytest.mark.parametrize(
    "kw, field",
    [(dict(dtype="float64"), "dtype"), (dict(device="cpu"), "device"), (dict(num_heads=4), "num_heads")],
)
def test_options_for_a_model_already_made_are_refused_naming_them(kw, field):
    with pytest.raises(InvalidInputError) as e:
        HartsEngine.build(HybridModel(model_config("debug")), **kw)
    assert e.value.field == field and "\n" not in str(e.value)


def test_an_unknown_source_is_refused_naming_it():
    with pytest.raises(InvalidInputError) as e:
        HartsEngine.build(3.5)
    assert e.value.field == "source" and "ModelConfig" in str(e.value)
