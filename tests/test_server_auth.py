"""The API key: where it comes from (file, environment, flag), how it is checked (bearer
scheme in any case, constant-time compare, WWW-Authenticate on 401), what it protects
(everything but /health; /metrics and the docs too unless --public-metrics)."""

from __future__ import annotations

import httpx
import pytest
from test_server import server_fixture

from specdecode.cli import _serve_api_key, build_parser
from specdecode.errors import ConfigError

PROTECTED_DOCS = ["/metrics", "/docs", "/redoc", "/openapi.json"]


keyed = server_fixture(max_num_seqs=1, api_key="sekret")


keyed_public_metrics = server_fixture(max_num_seqs=1, api_key="sekret", public_metrics=True)


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Bearer sekret2", "Bearer", "Basic c2VrcmV0", "sekret",
                                    "Bearer sekre"])
def test_requests_without_the_right_key_get_401(keyed, header):
    headers = {"authorization": header} if header else {}
    assert_401(httpx.get(keyed.url + "/v1/models", headers=headers))
    assert_401(httpx.post(keyed.url + "/v1/completions", headers=headers, json={"model": "tiny", "prompt": "x"}))
    assert_401(httpx.get(keyed.url + "/v1/unknown", headers=headers))  # no route is revealed without the key


@pytest.mark.parametrize("header", ["Bearer sekret", "bearer sekret", "BEARER  sekret", "bEaReR sekret"])
def test_bearer_scheme_in_any_case(keyed, header):
    r = httpx.get(keyed.url + "/v1/models", headers={"authorization": header})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


def test_metrics_and_docs_need_the_key_unless_public(keyed, keyed_public_metrics):
    for path in PROTECTED_DOCS:
        assert_401(httpx.get(keyed.url + path))
        assert httpx.get(keyed.url + path, headers={"authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(keyed_public_metrics.url + path).status_code == 200, path
    for srv in (keyed, keyed_public_metrics):
        assert httpx.get(srv.url + "/health").status_code == 200  # always public
        assert_401(httpx.get(srv.url + "/v1/models"))
    r = httpx.get(keyed.url + "/v1/unknown", headers={"authorization": "Bearer sekret"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_openai_client_with_the_key(keyed):
    import openai

    assert keyed.client("sekret").models.list().data[0].id == "tiny"
    with pytest.raises(openai.AuthenticationError):
        keyed.client("wrong").models.list()


def _key(argv, monkeypatch, env=None):
    monkeypatch.delenv("SPECDECODE_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("SPECDECODE_API_KEY", env)
    return _serve_api_key(build_parser().parse_args(["serve", *argv]))


def test_api_key_sources(monkeypatch, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert _key(["--api-key-file", str(key_file)], monkeypatch, env="from-env") == "from-file"
    assert _key(["--api-key", "from-flag"], monkeypatch, env="from-env") == "from-flag"
    assert _key([], monkeypatch, env=" from-env\n") == "from-env"
    assert _key([], monkeypatch) is None
    assert _key([], monkeypatch, env="") is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        _key(["--api-key-file", str(tmp_path / "empty")], monkeypatch)
    with pytest.raises(ConfigError, match="cannot be read"):
        _key(["--api-key-file", str(tmp_path / "missing")], monkeypatch)
    with pytest.raises(SystemExit):  # one of the two flags
        build_parser().parse_args(["serve", "--api-key", "a", "--api-key-file", str(key_file)])
