"""Checkpoint tensor keys: `model.<param>` and `optim.<param>.<state>`, by global name."""

from relaytrain.checkpoint.keys import model_key, model_tensors, optim_key, tensor_param


def test_every_key_names_its_parameter():
    name = "layers.3.attn.q_norm.weight"
    assert tensor_param(model_key(name)) == name
    for state in ("exp_avg", "exp_avg_sq", "step"):
        assert tensor_param(optim_key(name, state)) == name


def test_model_tensors_are_the_weights_by_parameter_name():
    tensors = {model_key("embed.weight"): 1, optim_key("embed.weight", "step"): 2,
               model_key("norm.weight"): 3}
    assert model_tensors(tensors) == {"embed.weight": 1, "norm.weight": 3}
