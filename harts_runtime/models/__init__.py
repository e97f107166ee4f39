"""Model families, one package each with ``args.py`` (keyword config + named flavors) and
``model.py`` (the modules), as torchtitan's ``models/<name>/model/{args,model}.py``.

Families: :mod:`~harts_runtime.models.hybrid` (KDA / MLA / GQA mixers, dense / MoE FFNs; flavors
``ling-tiny`` and ``debug``).
"""

from harts_runtime.models.hybrid import FLAVORS, HybridModel, ModelConfig, model_config

__all__ = ["FLAVORS", "HybridModel", "ModelConfig", "model_config"]
