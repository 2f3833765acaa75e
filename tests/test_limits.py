"""The seed and temperature ranges (flashnorm_mlx/limits.py) are one for the CLI
and the server, and they are MLX's: both refuse the same values, each in its own
way (the CLI: one line and exit 2 before MLX is imported; the server: a 400
naming the field), and both take the edges. Reference: mx.random.key, which
takes a uint64 seed, as mlx-lm's generate and server pass it on."""

import pytest

from flashnorm_mlx.cli import main
from flashnorm_mlx.serve.schema import RequestError, Settings, read_requests

MESSAGES = [{"role": "user", "content": "hi"}]

REFUSED = [
    ("seed", 2**64, "--seed"),
    ("seed", -1, "--seed"),
    ("temperature", -0.5, "--temp"),
    ("temperature", float("inf"), "--temp"),
]
TAKEN = [
    ("seed", 2**64 - 1, "--seed"),
    ("seed", 0, "--seed"),
    ("temperature", 7.0, "--temp"),
]


def _server(field, value):
    body = {"messages": MESSAGES, field: value}
    (request,) = read_requests(
        "chat", body, [[1, 2]], "messages", Settings(), "m", 10, lambda: 0
    )
    return request


@pytest.mark.parametrize("field,value,flag", REFUSED)
def test_cli_and_server_refuse_the_same_values(field, value, flag, capsys):
    code = main(["generate", flag, str(value)])
    err = capsys.readouterr().err
    print(err)
    assert code == 2 and f"{flag} must be" in err and str(value) in err, err
    assert err.count("\n") == 1, err
    with pytest.raises(RequestError) as e:
        _server(field, value)
    print(e.value.body())
    assert e.value.status == 400 and e.value.param == field, e.value.body()
    assert e.value.message.startswith(f"'{field}' must be"), e.value.message
    # The same words for the range, from the same place.
    said = err.split(" must be ")[1].split(", not")[0]
    assert said in e.value.message, (said, e.value.message)


@pytest.mark.parametrize("field,value,flag", TAKEN)
def test_cli_and_server_take_the_edges(field, value, flag):
    from flashnorm_mlx.cli import generate

    args = generate.setup_arg_parser().parse_args([flag, str(value)])
    dest = flag[2:]
    assert getattr(args, dest) == value, (dest, getattr(args, dest))
    request = _server(field, value)
    assert getattr(request, "seed" if field == "seed" else "temp") == value


def test_the_seed_range_is_mlxs():
    import mlx.core as mx

    from flashnorm_mlx.limits import SEED_LIMIT

    mx.random.key(SEED_LIMIT - 1)  # the largest seed is taken
    for bad in (SEED_LIMIT, -1):
        with pytest.raises((OverflowError, TypeError, ValueError)):
            mx.random.key(bad)


def test_the_loader_and_the_flags_take_the_same_quantization_settings():
    """-q's --q-bits/--q-group-size offer what a checkpoint's config may say
    (loading/config_checks.py), and the refusal names that list."""
    from flashnorm_mlx.cli import generate
    from flashnorm_mlx.errors import LoadError
    from flashnorm_mlx.limits import GROUP_SIZES, WEIGHT_BITS
    from flashnorm_mlx.loading.config_checks import check_config

    choices = {a.dest: a.choices for a in generate.setup_arg_parser()._actions}
    assert tuple(choices["q_bits"]) == WEIGHT_BITS, choices["q_bits"]
    assert tuple(choices["q_group_size"]) == GROUP_SIZES, choices["q_group_size"]
    wrong = []
    for bits in range(0, 10):
        for group in (16, 32, 48, 64, 128, 256):
            q = {"bits": bits, "group_size": group}
            try:
                check_config({"quantization": q}, "config.json", ())
                taken, said = True, ""
            except LoadError as e:
                taken, said = False, str(e)
            if taken != (bits in WEIGHT_BITS and group in GROUP_SIZES):
                wrong.append((q, said))
            if not taken and bits not in WEIGHT_BITS:
                assert "need 2, 3, 4, 5, 6 or 8" in said, said
    assert not wrong, wrong
