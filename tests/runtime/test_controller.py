"""What a resumed run may change: how the model executes, never what defines its curve."""

import pytest

from relaytrain.config import load_config
from relaytrain.errors import ConfigError
from relaytrain.runtime.controller import check_resume_compatible


def saved_config(*overrides: str) -> dict:
    return load_config(None, ["run_dir=x", *overrides]).to_dict()


def test_execution_keys_may_change_on_resume():
    saved = saved_config("model.matmul=aten", "model.checkpointing=full")
    check_resume_compatible(saved, load_config(None, ["run_dir=x", "model.matmul=onednn"]))


def test_a_checkpoint_from_before_model_matmul_existed_resumes():
    saved = saved_config()
    del saved["model"]["matmul"]
    check_resume_compatible(saved, load_config(None, ["run_dir=x"]))


def test_a_change_to_the_model_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="'model.overrides'") as err:
        check_resume_compatible(saved_config(), load_config(None, ["run_dir=x",
                                                                   "model.n_layers=3"]))
    assert "\n" not in str(err.value)
