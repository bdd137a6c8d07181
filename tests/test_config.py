"""Tests for EngineConfig: defaults, validation, YAML, environment and precedence."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_async import config as config_mod
from lmcache_async.config import CONFIG_FILE_ENV, GB, EngineConfig
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.tenancy.tenants import tenant_tag

EXPECTED_DEFAULTS: dict[str, Any] = {
    "chunk_size": 256,
    "local_cpu": True,
    "max_local_cpu_size": 5.0,
    "save_unfull_chunk": True,
    "prefault_pool": True,
    "hash_algorithm": "blake3",
    "pin_timeout": 60.0,
    "allocation_timeout": 5.0,
    "retrieve_timeout": 30.0,
    "store_timeout": 60.0,
    "pipeline_queue_size": 8,
    "pipeline_batch_chunks": 8,
    "inline_copy_bytes": 4 * 1024 * 1024,
    "inline_hash_tokens": 65536,
    "enable_kv_events": True,
    "max_kv_events": 10000,
    "max_kv_event_bytes": 64 << 20,
    "local_disk": None,
    "max_local_disk_size": 20.0,
    "remote_url": None,
    "remote_timeout": 2.0,
    "remote_ttl": None,
    "tier_codec": "none",
    "store_location": None,
    "retrieve_locations": None,
    "wait_for_slow_tiers": False,
    "slow_tier_queue_size": 64,
    "store_threshold": 1,
    "health_check_interval": 1.0,
    "remove_after_retrieve": False,
    "use_layerwise": False,
    "tenant_quotas": None,
    "tenant_labels": None,
    "encryption_key_file": None,
    "log_level": None,
    "log_format": "console",
}


def test_defaults() -> None:
    cfg = EngineConfig()
    assert cfg.to_dict() == EXPECTED_DEFAULTS
    assert list(cfg.to_dict()) == list(EXPECTED_DEFAULTS)
    assert cfg.cpu_capacity_bytes == 5 * 1024**3
    assert config_mod.DEFAULT_CHUNK_SIZE == 256
    assert config_mod.DEFAULT_INLINE_COPY_BYTES == 4 * 1024 * 1024


def test_every_field_has_a_default_constant() -> None:
    for name, value in EXPECTED_DEFAULTS.items():
        assert getattr(config_mod, "DEFAULT_" + name.upper()) == value


def test_cpu_capacity_bytes_uses_binary_gigabytes() -> None:
    assert EngineConfig(max_local_cpu_size=0.5).cpu_capacity_bytes == GB // 2
    assert EngineConfig(max_local_cpu_size=2).cpu_capacity_bytes == 2 * 1024**3


INVALID_VALUES: list[tuple[str, Any]] = [
    ("local_disk", ""),
    ("local_disk", "file://"),
    ("local_disk", 3),
    ("max_local_disk_size", 0),
    ("max_local_disk_size", -2.0),
    ("remote_url", "http://localhost:6379"),
    ("remote_url", "localhost:6379"),
    ("remote_url", "redis://"),
    ("remote_url", 6379),
    ("remote_timeout", 0),
    ("remote_ttl", -1),
    ("remote_ttl", "60"),
    ("tier_codec", "gzip"),
    ("store_location", ["gpu"]),
    ("store_location", []),
    ("store_location", ["cpu", "cpu"]),
    ("retrieve_locations", "disk,nvme"),
    ("retrieve_locations", 3),
    ("wait_for_slow_tiers", "yes"),
    ("slow_tier_queue_size", 0),
    ("store_threshold", 0),
    ("store_threshold", 1.5),
    ("store_threshold", True),
    ("health_check_interval", 0.0),
    ("remove_after_retrieve", 1),
    ("use_layerwise", None),
    ("chunk_size", 0),
    ("chunk_size", -256),
    ("chunk_size", 256.0),
    ("chunk_size", True),
    ("chunk_size", "256"),
    ("local_cpu", 1),
    ("local_cpu", "true"),
    ("local_cpu", None),
    ("max_local_cpu_size", 0),
    ("max_local_cpu_size", -1.5),
    ("max_local_cpu_size", float("nan")),
    ("max_local_cpu_size", float("inf")),
    ("max_local_cpu_size", "5"),
    ("max_local_cpu_size", False),
    ("save_unfull_chunk", 0),
    ("prefault_pool", "no"),
    ("hash_algorithm", "sha256"),
    ("hash_algorithm", "BLAKE3"),
    ("hash_algorithm", 3),
    ("pin_timeout", 0.0),
    ("pin_timeout", -1),
    ("pin_timeout", "60"),
    ("allocation_timeout", 0),
    ("allocation_timeout", True),
    ("retrieve_timeout", -0.1),
    ("retrieve_timeout", None),
    ("store_timeout", 0),
    ("store_timeout", float("inf")),
    ("pipeline_queue_size", 0),
    ("pipeline_queue_size", 2.0),
    ("pipeline_batch_chunks", 0),
    ("pipeline_batch_chunks", False),
    ("inline_copy_bytes", -1),
    ("inline_copy_bytes", 1.5),
    ("inline_hash_tokens", -1),
    ("inline_hash_tokens", "16384"),
    ("enable_kv_events", "yes"),
    ("max_kv_events", 0),
    ("max_kv_events", True),
    ("max_kv_event_bytes", 0),
    ("log_level", "TRACE"),
    ("log_level", "warn"),
    ("log_level", 20),
    ("log_format", "xml"),
    ("log_format", None),
    ("tenant_quotas", "cpu.a=-1"),
    ("tenant_quotas", {"gpu": {"a": 1}}),
    ("tenant_quotas", {"cpu": {"a": True}}),
    ("tenant_quotas", "cpu.a=6"),  # larger than the 5 GB CPU tier
    ("tenant_quotas", {"disk": {"a": 1}}),  # no disk tier
    ("tenant_quotas", 3),
    ("tenant_labels", ["a"]),
    ("tenant_labels", {"a": ""}),
    ("tenant_labels", {"a": 7}),
    ("tenant_labels", {"a": "x" * 65}),
    ("tenant_labels", {"a": "line\nbreak"}),
    ("tenant_labels", {"a": "same", "b": "same"}),
    ("tenant_labels", {"a": "(none)"}),
    ("tenant_labels", {"a": "other"}),
    ("tenant_labels", {"a": "0" * 32}),  # reads like another tenant's tag
    ("tenant_labels", {"x" * 257: "too-long-a-name"}),
    ("tenant_labels", {3: "not-a-name"}),
    ("tenant_labels", "{a: [1"),
    ("encryption_key_file", ""),
    ("encryption_key_file", 7),
]


@pytest.mark.parametrize(("field", "value"), INVALID_VALUES)
def test_invalid_value_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    # A field may name its part: tenant_quotas.cpu.alice.
    assert info.value.field == field or info.value.field.startswith(field + ".")
    assert str(info.value).startswith(info.value.field + ": ")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("cpu.a=-1", "tenant_quotas.cpu.a"),
        ({"cpu": {"a": True}}, "tenant_quotas.cpu.a"),
        ({"gpu": {"a": 1}}, "tenant_quotas.gpu"),
        ("cpu.a=6", "tenant_quotas.cpu"),
        ("cpu.a=3,cpu.b=3", "tenant_quotas.cpu"),  # 6 GB of named quotas in 5
        ({"disk": {"a": 1}}, "tenant_quotas.disk"),
        ({"redis": {"a": 1}}, "tenant_quotas.redis"),
        ("cpu.a=1,cpu.a=2", "tenant_quotas.cpu.a"),
        ("cpu.a", "tenant_quotas"),
        ({"cpu": {}}, "tenant_quotas.cpu"),
    ],
)
def test_a_bad_quota_names_its_part(value: Any, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(tenant_quotas=value)
    assert info.value.field == field


def test_quotas_parse_from_text_and_mapping_alike_and_round_trip() -> None:
    text = EngineConfig(tenant_quotas="cpu.alice=1.5, cpu.*=0.5")
    mapping = EngineConfig(tenant_quotas={"cpu": {"alice": 1.5, "*": 0.5}})
    assert text.tenant_quotas == mapping.tenant_quotas
    cpu = text.tenant_quotas.tier("cpu") if text.tenant_quotas else None
    assert cpu is not None
    assert cpu.limit("alice") == int(1.5 * 1024**3)
    assert cpu.limit("bob") == cpu.limit(None) == 512 * 1024**2
    assert EngineConfig.from_dict(text.to_dict()) == text
    env = EngineConfig.load(environ={"LMCACHE_ASYNC_TENANT_QUOTAS": "cpu.alice=1.5,cpu.*=0.5"})
    assert env.tenant_quotas == text.tenant_quotas


def test_tenant_labels_parse_from_a_mapping_and_text_and_round_trip(tmp_path: Path) -> None:
    secret = "s3cr3t-salt=="
    mapping = EngineConfig(tenant_labels={secret: "team-a", "b": "team-b"})
    labels = mapping.tenant_labels
    assert labels is not None
    assert labels.label(tenant_tag(secret)) == "team-a"
    assert labels.label(tenant_tag("b")) == "team-b"
    assert labels.label(tenant_tag("c")) == tenant_tag("c").hex()  # no label: the tag
    assert labels.label(tenant_tag(None)) == "(none)"
    assert EngineConfig.from_dict(mapping.to_dict()) == mapping
    text = '{"s3cr3t-salt==": team-a, b: team-b}'
    env = EngineConfig.load(environ={"LMCACHE_ASYNC_TENANT_LABELS": text})
    assert env.tenant_labels == labels
    path = tmp_path / "labels.yaml"
    path.write_text(yaml.safe_dump(mapping.to_dict()))
    assert EngineConfig.from_file(path).tenant_labels == labels


def test_a_bad_label_never_repeats_the_secret_name() -> None:
    secret = "s3cr3t-salt"
    for value in ({secret: ""}, {secret: "x", "other-salt": "x"}, {secret * 30: "long"}):
        with pytest.raises(ConfigError) as info:
            EngineConfig(tenant_labels=value)
        assert secret not in str(info.value)


def test_every_field_has_an_invalid_case() -> None:
    assert {field for field, _ in INVALID_VALUES} == set(EngineConfig.field_names())


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        EngineConfig(chunk_size=0)
    assert issubclass(ConfigError, InvalidInputError)


def test_type_error_messages_say_what_was_expected() -> None:
    with pytest.raises(ConfigError, match=r"chunk_size: expected an int, got bool \(True\)"):
        EngineConfig(chunk_size=True)
    with pytest.raises(ConfigError, match=r"pin_timeout: expected a number, got str \('60'\)"):
        EngineConfig(pin_timeout="60")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"chunk_size: must be > 0, got 0"):
        EngineConfig(chunk_size=0)
    with pytest.raises(ConfigError, match=r"pipeline_queue_size: must be >= 1, got 0"):
        EngineConfig(pipeline_queue_size=0)
    with pytest.raises(ConfigError, match=r"expected one of 'blake3', 'xxh3_128', got 'md5'"):
        EngineConfig(hash_algorithm="md5")


def test_boundary_values_are_accepted() -> None:
    cfg = EngineConfig(
        chunk_size=1,
        pipeline_queue_size=1,
        pipeline_batch_chunks=1,
        inline_copy_bytes=0,
        inline_hash_tokens=0,
        max_kv_events=1,
        pin_timeout=1e-3,
        hash_algorithm="xxh3_128",
        log_format="json",
    )
    assert (cfg.chunk_size, cfg.inline_copy_bytes, cfg.max_kv_events) == (1, 0, 1)
    assert cfg.hash_algorithm == "xxh3_128"


def test_ints_are_accepted_and_stored_as_floats() -> None:
    cfg = EngineConfig(max_local_cpu_size=3, pin_timeout=10)
    assert cfg.max_local_cpu_size == 3.0
    assert type(cfg.max_local_cpu_size) is float
    assert type(cfg.pin_timeout) is float


def test_log_level_is_case_insensitive_and_stored_upper() -> None:
    assert EngineConfig(log_level="debug").log_level == "DEBUG"
    assert EngineConfig(log_level="Warning").log_level == "WARNING"


def test_frozen() -> None:
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 512  # type: ignore[misc]
    assert cfg.chunk_size == 256
    assert hash(cfg) == hash(EngineConfig())


def test_replace_validates() -> None:
    cfg = EngineConfig()
    bigger = cfg.replace(chunk_size=512, log_level="error")
    assert (bigger.chunk_size, bigger.log_level) == (512, "ERROR")
    assert cfg.chunk_size == 256
    with pytest.raises(ConfigError) as info:
        cfg.replace(chunk_size=-1)
    assert info.value.field == "chunk_size"
    with pytest.raises(ConfigError, match="did you mean 'chunk_size'") as info:
        cfg.replace(chunk_sise=512)
    assert info.value.field == "chunk_sise"


def test_from_dict_and_to_dict_round_trip() -> None:
    cfg = EngineConfig(chunk_size=128, local_cpu=False, max_local_cpu_size=1.25)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert EngineConfig.from_dict({}) == EngineConfig()


def test_from_dict_unknown_key_suggests_the_right_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'max_local_cpu_size'") as info:
        EngineConfig.from_dict({"max_local_cpu_sze": 2})
    assert info.value.field == "max_local_cpu_sze"


def test_from_dict_unknown_key_without_a_close_match() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"zzz": 1})
    assert info.value.field == "zzz"
    assert "did you mean" not in str(info.value)


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = EngineConfig(
        chunk_size=64,
        local_cpu=False,
        max_local_cpu_size=0.75,
        hash_algorithm="xxh3_128",
        inline_copy_bytes=0,
        log_level="debug",
        log_format="json",
    )
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()), encoding="utf-8")
    assert EngineConfig.from_file(path) == cfg
    assert EngineConfig.from_file(str(path)).to_dict() == cfg.to_dict()


def test_yaml_unknown_key_is_named_with_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("chunk_size: 128\npipline_queue_size: 4\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_file(path)
    assert info.value.field == "pipline_queue_size"
    assert "did you mean 'pipeline_queue_size'?" in str(info.value)
    assert str(path) in str(info.value)


def test_yaml_bad_value_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("chunk_size: '128'\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_file(path)
    assert info.value.field == "chunk_size"


def test_yaml_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="cannot read") as info:
        EngineConfig.from_file(missing)
    assert info.value.field == "config_file"
    assert str(missing) in str(info.value)


def test_yaml_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_file(tmp_path)
    assert info.value.field == "config_file"


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "42\n"])
def test_yaml_non_mapping_document(tmp_path: Path, text: str) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="must hold a mapping") as info:
        EngineConfig.from_file(path)
    assert info.value.field == "config_file"


def test_yaml_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("chunk_size: [1, 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        EngineConfig.from_file(path)
    assert info.value.field == "config_file"


def test_yaml_non_string_key(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("1: 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="must be a string") as info:
        EngineConfig.from_file(path)
    assert info.value.field == "1"


def test_yaml_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("", encoding="utf-8")
    assert EngineConfig.from_file(path) == EngineConfig()


def test_env_parses_every_type() -> None:
    environ = {
        "LMCACHE_ASYNC_CHUNK_SIZE": " 512 ",
        "LMCACHE_ASYNC_LOCAL_CPU": "off",
        "LMCACHE_ASYNC_SAVE_UNFULL_CHUNK": "Yes",
        "LMCACHE_ASYNC_ENABLE_KV_EVENTS": "0",
        "LMCACHE_ASYNC_MAX_LOCAL_CPU_SIZE": "2.5",
        "LMCACHE_ASYNC_PIN_TIMEOUT": "7",
        "LMCACHE_ASYNC_HASH_ALGORITHM": "xxh3_128",
        "LMCACHE_ASYNC_LOG_LEVEL": "debug",
        "PATH": "/usr/bin",
        "LMCACHE_OTHER": "ignored",
    }
    overrides = EngineConfig.env_overrides(environ)
    assert overrides == {
        "chunk_size": 512,
        "local_cpu": False,
        "save_unfull_chunk": True,
        "enable_kv_events": False,
        "max_local_cpu_size": 2.5,
        "pin_timeout": 7.0,
        "hash_algorithm": "xxh3_128",
        "log_level": "debug",
    }
    assert type(overrides["chunk_size"]) is int
    assert type(overrides["pin_timeout"]) is float
    cfg = EngineConfig.from_dict(overrides)
    assert cfg.log_level == "DEBUG"
    assert cfg.cpu_capacity_bytes == int(2.5 * GB)


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("OFF", False),
    ],
)
def test_env_bool_words(word: str, expected: bool) -> None:
    assert EngineConfig.env_overrides({"LMCACHE_ASYNC_LOCAL_CPU": word}) == {"local_cpu": expected}


@pytest.mark.parametrize(
    ("var", "value", "field"),
    [
        ("LMCACHE_ASYNC_CHUNK_SIZE", "abc", "chunk_size"),
        ("LMCACHE_ASYNC_CHUNK_SIZE", "2.5", "chunk_size"),
        ("LMCACHE_ASYNC_CHUNK_SIZE", "", "chunk_size"),
        ("LMCACHE_ASYNC_LOCAL_CPU", "maybe", "local_cpu"),
        ("LMCACHE_ASYNC_LOCAL_CPU", "2", "local_cpu"),
        ("LMCACHE_ASYNC_MAX_LOCAL_CPU_SIZE", "5GB", "max_local_cpu_size"),
        ("LMCACHE_ASYNC_STORE_TIMEOUT", "soon", "store_timeout"),
    ],
)
def test_env_bad_value_names_the_field(var: str, value: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.env_overrides({var: value})
    assert info.value.field == field
    assert repr(value) in str(info.value)


def test_env_out_of_range_value_is_caught_at_load() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(environ={"LMCACHE_ASYNC_CHUNK_SIZE": "-4"})
    assert info.value.field == "chunk_size"


def test_env_unknown_variable_is_an_error() -> None:
    with pytest.raises(ConfigError, match="did you mean 'LMCACHE_ASYNC_CHUNK_SIZE'") as info:
        EngineConfig.env_overrides({"LMCACHE_ASYNC_CHUNK_SIZ": "4"})
    assert info.value.field == "LMCACHE_ASYNC_CHUNK_SIZ"


def test_env_config_file_variable_is_not_a_field() -> None:
    assert EngineConfig.env_overrides({CONFIG_FILE_ENV: "/somewhere.yaml"}) == {}


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_ASYNC_MAX_KV_EVENTS", "17")
    assert EngineConfig.env_overrides()["max_kv_events"] == 17
    monkeypatch.delenv(CONFIG_FILE_ENV, raising=False)
    assert EngineConfig.load().max_kv_events == 17


def test_load_precedence_defaults_file_env_kwargs(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(
        yaml.safe_dump({"chunk_size": 128, "pin_timeout": 11.0, "store_timeout": 12.0}),
        encoding="utf-8",
    )
    environ = {
        "LMCACHE_ASYNC_PIN_TIMEOUT": "21",
        "LMCACHE_ASYNC_STORE_TIMEOUT": "22",
    }
    cfg = EngineConfig.load(path, environ=environ, store_timeout=33.0)
    assert cfg.retrieve_timeout == 30.0  # default
    assert cfg.chunk_size == 128  # file
    assert cfg.pin_timeout == 21.0  # environment over file
    assert cfg.store_timeout == 33.0  # keyword over environment and file


def test_load_reads_config_file_env(tmp_path: Path) -> None:
    path = tmp_path / "from_env.yaml"
    path.write_text("chunk_size: 32\nlocal_cpu: false\n", encoding="utf-8")
    cfg = EngineConfig.load(environ={CONFIG_FILE_ENV: str(path)})
    assert (cfg.chunk_size, cfg.local_cpu) == (32, False)


def test_load_explicit_path_wins_over_config_file_env(tmp_path: Path) -> None:
    explicit = tmp_path / "explicit.yaml"
    explicit.write_text("chunk_size: 16\n", encoding="utf-8")
    other = tmp_path / "other.yaml"
    other.write_text("chunk_size: 32\n", encoding="utf-8")
    cfg = EngineConfig.load(explicit, environ={CONFIG_FILE_ENV: str(other)})
    assert cfg.chunk_size == 16


def test_load_missing_config_file_from_env(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(environ={CONFIG_FILE_ENV: str(tmp_path / "missing.yaml")})
    assert info.value.field == "config_file"


def test_load_later_source_fixes_an_earlier_one(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("chunk_size: 0\n", encoding="utf-8")
    assert EngineConfig.load(path, environ={}, chunk_size=64).chunk_size == 64


def test_load_unknown_override_is_named() -> None:
    with pytest.raises(ConfigError, match="did you mean 'store_timeout'") as info:
        EngineConfig.load(environ={}, stor_timeout=1.0)
    assert info.value.field == "stor_timeout"


def test_load_with_nothing_is_defaults() -> None:
    assert EngineConfig.load(environ={}) == EngineConfig()


def test_tier_settings_parse_from_every_source(tmp_path: Path) -> None:
    cfg = EngineConfig(
        local_disk=f"file://{tmp_path}", store_location="cpu, disk", retrieve_locations=["redis"]
    )
    assert cfg.disk_directory == str(tmp_path)
    assert cfg.store_location == ("cpu", "disk")
    assert cfg.retrieve_locations == ("redis",)
    assert cfg.disk_capacity_bytes == 20 * GB
    env = {
        "LMCACHE_ASYNC_STORE_LOCATION": "disk,redis",
        "LMCACHE_ASYNC_REMOTE_TTL": "none",
        "LMCACHE_ASYNC_REMOTE_URL": "redis-cluster://127.0.0.1:7000,127.0.0.1:7001",
    }
    loaded = EngineConfig.load(environ=env)
    assert loaded.store_location == ("disk", "redis")
    assert loaded.remote_ttl is None
    assert loaded.remote_url == "redis-cluster://127.0.0.1:7000,127.0.0.1:7001"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert EngineConfig.from_file(path) == cfg
