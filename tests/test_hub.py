"""Push -> pull round trips through Hub servers on 127.0.0.1: our test Hub (tests/hub_server.py) and olah.

A tiny trained checkpoint (model, BPE tokenizer, metrics, model card) is pushed with
``decoderlab.push``; fresh Python processes with an empty ``HF_HOME`` and ``HF_ENDPOINT`` set to the
server pull it back, with decoderlab hidden (remote code, pinned revision) or installed, and must give
the original's logits and greedy text exactly. Nothing here reaches past 127.0.0.1: in this process
huggingface_hub's endpoint is patched to the test Hub, and each child process gets its own endpoint.
"""

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
import torch
from conftest import free_port
from hub_server import HubServer
from huggingface_hub import HfApi, ModelCard, get_hf_file_metadata, hf_hub_url
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, pipeline

import decoderlab
from decoderlab.model_card import HUB_ID_PLACEHOLDER, write_model_card
from decoderlab.push import HubAccessError, push_to_hub
from tests.paths import INPUT_TXT, REPO_ROOT
from tests.training_runs import HIDE_DECODERLAB

OLAH = REPO_ROOT / ".venv-olah/bin/olah-cli"
PROMPT = "ROMEO:"
NEW_TOKENS = 12

# A getaddrinfo that resolves 127.0.0.1 only: installed first in every child process, and in this one while
# the test Hub runs
NETWORK_GUARD = """
import socket
_getaddrinfo = socket.getaddrinfo
def _local_only(host, *args, **kwargs):
    if host not in ("127.0.0.1", "localhost", b"127.0.0.1", b"localhost"):
        raise OSError(f"test network guard: refusing to resolve {host!r}; tests reach 127.0.0.1 only")
    return _getaddrinfo(host, *args, **kwargs)
"""

# The pull: load everything a user would from the Hub id, then report what was loaded and its outputs
PULL = """
import json, sys
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

def refuse_unpickling(*args, **kwargs):
    raise AssertionError("a pull must never unpickle: weights are safetensors only")
torch.load = refuse_unpickling
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
if args["import_decoderlab"]:
    import decoderlab  # registers the Auto classes: no remote code needed
kwargs = {"revision": args["revision"]} | ({"trust_remote_code": True} if args["remote_code"] else {})
repo = args["repo"]
config = AutoConfig.from_pretrained(repo, **kwargs)
base = AutoModel.from_pretrained(repo, **kwargs)
model = AutoModelForCausalLM.from_pretrained(repo, **kwargs).eval()
tokenizer = AutoTokenizer.from_pretrained(repo, revision=args["revision"])
with torch.no_grad():
    logits = model(torch.tensor(args["input_ids"])).logits
save_file({"logits": logits.contiguous()}, args["out"] + "/logits.safetensors")
generate = pipeline("text-generation", model=repo, **kwargs)
text = generate(args["prompt"], max_new_tokens=args["new_tokens"], do_sample=False)[0]["generated_text"]
report = {
    "config_class": type(config).__module__ + "." + type(config).__name__,
    "base_class": type(base).__name__,
    "model_module": type(model).__module__,
    "tokenizer_ids": tokenizer(args["prompt"]).input_ids,
    "text": text,
    "decoderlab_imported": "decoderlab" in sys.modules,
}
(open(args["out"] + "/report.json", "w")).write(json.dumps(report))
"""


def client_env(endpoint: str, home: pathlib.Path, token: str | None = None) -> dict:
    """The environment of a fresh Hub client: only ``endpoint``, an empty HF_HOME, no inherited HF settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(
        HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )  # fmt: skip
    if token:
        env["HF_TOKEN"] = token
    return env


def run_child(code: str, args: list[str], env: dict, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", NETWORK_GUARD + "socket.getaddrinfo = _local_only\n" + code, *args]
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        raise AssertionError(f"child process failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


# ----------------------------------------------------------------------------------------------
# Fixtures: the test Hub, a tiny trained checkpoint, and its reference outputs


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The test Hub, with this process's huggingface_hub pointed at it (and online only for it)."""
    tmp = tmp_path_factory.mktemp("hub")
    with HubServer(tmp / "repos") as server, pytest.MonkeyPatch.context() as patch:
        guard = {}
        exec(NETWORK_GUARD, guard)  # defines _local_only: the children's guard, for this process
        patch.setattr(socket, "getaddrinfo", guard["_local_only"])
        patch.setenv("NO_PROXY", "127.0.0.1,localhost")  # a proxy from the environment must not see test traffic
        patch.setattr(hub_constants, "ENDPOINT", server.url)
        resolve_url = server.url + "/{repo_id}/resolve/{revision}/{filename}"
        patch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", resolve_url)
        patch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
        patch.setattr(hub_constants, "AGENT_HARNESSES_PATH", str(tmp / "agent_harnesses.json"))
        yield server


def train_tokenizer(text: str) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tokenizer.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint folder as the training scripts leave it, plus the model object and its tokenizer.

    20 AdamW steps on Tiny Shakespeare give real metrics and a model whose greedy text is not all one token.
    """
    torch.manual_seed(0)
    text = INPUT_TXT.read_text(encoding="utf-8")[:20_000]
    tokenizer = train_tokenizer(text)
    config = decoderlab.DecoderLabConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = decoderlab.DecoderLabForCausalLM(config)
    data = torch.tensor(tokenizer(text).input_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    records = []
    for step in range(1, 21):
        starts = torch.randint(0, len(data) - 33, (8,)).tolist()
        batch = torch.stack([data[s : s + 33] for s in starts])
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        records.append({"step": step, "train_loss": loss.item(), "lr": 3e-3, "tokens": step * 8 * 32, "elapsed_s": 0.1})
    model.eval()

    folder = tmp_path_factory.mktemp("checkpoints") / "tiny-shakespeare"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    intermediate = folder / "checkpoint-10"  # what a training run leaves behind: never pushed unless asked
    model.save_pretrained(intermediate)
    (intermediate / "optimizer.bin").write_bytes(b"\x80\x04 pickled optimizer state")
    write_model_card(folder, dataset="karpathy/tiny_shakespeare", training={"batch_size": 8, "block_size": 32})
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Logits and greedy text of the original model, in this process, with the threads the children use."""
    _, model, tokenizer = checkpoint
    input_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids).logits
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    return {"input_ids": input_ids.tolist(), "logits": logits, "text": text, "ids": tokenizer(PROMPT).input_ids}


@pytest.fixture(scope="module")
def pushed(hub, checkpoint):
    """The checkpoint pushed with the Python API: (repo id, commit hash)."""
    folder, _, _ = checkpoint
    repo_id = "decoderlab-org/tiny-shakespeare"
    commit_url = push_to_hub(folder, repo_id, token=hub.token)
    return repo_id, commit_url.rsplit("/", 1)[-1]


def pull(endpoint: str, repo_id: str, revision: str, reference: dict, tmp: pathlib.Path, *, hide: bool) -> tuple:
    """Pull in a fresh process; returns (its report, its logits)."""
    tmp.mkdir()
    args = {
        "repo": repo_id, "revision": revision, "remote_code": hide, "import_decoderlab": not hide,
        "input_ids": reference["input_ids"], "prompt": PROMPT, "new_tokens": NEW_TOKENS,
        "threads": torch.get_num_threads(), "out": str(tmp),
    }  # fmt: skip
    code = (HIDE_DECODERLAB if hide else "") + PULL
    run_child(code, [json.dumps(args)], client_env(endpoint, tmp / "hf_home"), cwd=tmp)
    return json.loads((tmp / "report.json").read_text()), load_file(tmp / "logits.safetensors")["logits"]


def assert_same_model(report: dict, logits: torch.Tensor, reference: dict) -> None:
    # Same code, same weights, same thread count: the logits are bitwise equal, not merely close
    assert torch.equal(logits, reference["logits"])
    assert report["text"] == reference["text"]
    assert report["tokenizer_ids"] == reference["ids"]
    assert report["base_class"] == "DecoderLabModel"


# ----------------------------------------------------------------------------------------------
# Push


def test_push_uploads_a_loadable_repository(hub, checkpoint, pushed):
    """The pushed commit holds the weights, both .py files, the tokenizer and the card naming the repo,
    and not the intermediate checkpoint-10/ folder."""
    repo_id, commit = pushed
    api = HfApi(token=hub.token)
    files = set(api.list_repo_files(repo_id, revision=commit))
    assert {
        "config.json", "configuration_decoderlab.py", "modeling_decoderlab.py", "kernels_decoderlab.py",
        "roles_decoderlab.py", "compat_decoderlab.py", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md", "metrics.jsonl",
        "training_curve.png",
    } <= files  # fmt: skip
    assert not any(name.startswith("checkpoint-10") for name in files)
    card = ModelCard(hub.read(repo_id, commit, "README.md").decode())
    assert f'from_pretrained("{repo_id}"' in card.text and HUB_ID_PLACEHOLDER not in card.text
    assert HUB_ID_PLACEHOLDER in (checkpoint[0] / "README.md").read_text()  # the local card is left as it was
    config = json.loads(hub.read(repo_id, commit, "config.json"))
    assert {"AutoConfig", "AutoModel", "AutoModelForCausalLM"} <= set(config["auto_map"])


def test_test_hub_speaks_the_hub_protocol(hub, pushed):
    """The test Hub answers as huggingface_hub expects: file metadata with the git blob id as ETag and the commit
    in X-Repo-Commit, and the error codes that become RepositoryNotFound / RevisionNotFound / EntryNotFound."""
    repo_id, commit = pushed
    api = HfApi()
    metadata = get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision="main", endpoint=hub.url))
    blob = next(f for f in api.list_repo_tree(repo_id, revision=commit) if f.path == "config.json").blob_id
    assert (metadata.commit_hash, metadata.etag) == (commit, blob)
    assert metadata.size == len(hub.read(repo_id, commit, "config.json"))
    assert api.file_exists(repo_id, "config.json", revision=commit)
    with pytest.raises(EntryNotFoundError):
        get_hf_file_metadata(hf_hub_url(repo_id, "absent.json", revision=commit, endpoint=hub.url))
    with pytest.raises(RevisionNotFoundError):
        api.model_info(repo_id, revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("decoderlab-org/no-such-repo")


def test_pushing_unchanged_folder_makes_no_commit(hub, checkpoint, pushed):
    """A second push of the same files keeps the head where it was (no empty commits)."""
    repo_id, commit = pushed
    again = push_to_hub(checkpoint[0], repo_id, token=hub.token)
    assert again.rsplit("/", 1)[-1] == commit


@pytest.mark.slow  # a fresh process importing torch and transformers
def test_cli_pushes_to_a_private_branch(hub, checkpoint, tmp_path):
    """`python -m decoderlab.push FOLDER ORG/NAME --private --revision dev` creates a private repository whose
    dev branch holds the checkpoint while main holds only the initial commit; anonymous reads are refused."""
    repo_id = "decoderlab-org/tiny-private"
    cli = "import runpy; runpy.run_module('decoderlab.push', run_name='__main__')"  # python -m decoderlab.push
    args = [str(checkpoint[0]), repo_id, "--private", "--revision", "dev"]
    result = run_child(cli, args, client_env(hub.url, tmp_path / "hf_home", token=hub.token), cwd=tmp_path)
    api = HfApi(token=hub.token)
    dev = api.model_info(repo_id, revision="dev")
    assert dev.private
    assert "model.safetensors" in {s.rfilename for s in dev.siblings}
    assert f'revision="{dev.sha}"' in result.stdout  # the CLI prints the pinned load line
    assert [s.rfilename for s in api.model_info(repo_id, revision="main").siblings] == [".gitattributes"]
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=False).model_info(repo_id)


@pytest.fixture(scope="module")
def training_folder(checkpoint, tmp_path_factory):
    """A folder as the training scripts leave it: the final model, plus a step_2/ Accelerate state (weights,
    pickled optimizer and RNG states) and a step_4.tmp/ still being written."""
    from accelerate import Accelerator

    folder = tmp_path_factory.mktemp("training") / "run"
    shutil.copytree(checkpoint[0], folder, ignore=shutil.ignore_patterns("checkpoint-*"))
    model = decoderlab.DecoderLabForCausalLM(checkpoint[1].config)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.save_state(str(folder / "step_2"))
    (folder / "step_4.tmp").mkdir()
    (folder / "step_4.tmp" / "optimizer.bin").write_bytes(b"half written")
    return folder


def test_push_includes_intermediate_checkpoints_only_when_asked(hub, training_folder):
    """Without include_checkpoints the step_N/ folders stay local; with it (which once failed on every training
    folder) they are uploaded as Accelerate wrote them, pickles included, while step_N.tmp/ (being
    written) never is; the pickle refusal still guards the model itself."""
    files_of = lambda commit: HfApi().list_repo_files("decoderlab-org/with-checkpoints", revision=commit)
    commit = push_to_hub(training_folder, "decoderlab-org/with-checkpoints", token=hub.token)
    assert not any(name.startswith("step_") for name in files_of(commit.rsplit("/", 1)[-1]))
    written = sorted(p.relative_to(training_folder).as_posix() for p in (training_folder / "step_2").rglob("*"))
    assert {"step_2/optimizer.bin", "step_2/random_states_0.pkl", "step_2/model.safetensors"} <= set(written)
    commit = push_to_hub(training_folder, "decoderlab-org/with-checkpoints", token=hub.token, include_checkpoints=True)
    files = files_of(commit.rsplit("/", 1)[-1])
    assert set(written) <= set(files)
    assert not any(name.startswith("step_4") for name in files)
    top_level_pickle = training_folder.parent / "pickled"
    shutil.copytree(training_folder, top_level_pickle)
    save_pickle(top_level_pickle / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle files would be uploaded: pytorch_model\.bin; delete them"):
        push_to_hub(top_level_pickle, "decoderlab-org/with-checkpoints", token=hub.token, include_checkpoints=True)


def test_push_without_a_token_is_one_line_naming_the_login(hub, checkpoint, tmp_path):
    """`python -m decoderlab.push` with no stored login and no HF_TOKEN: exit 1, one line naming the endpoint,
    `hf auth login` and HF_TOKEN, no traceback, no request sent and nothing written into the folder (which has
    no card, so a push would write one)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], folder, ignore=shutil.ignore_patterns("checkpoint-*", "README.md"))
    before = sorted(p.name for p in folder.iterdir())
    requests_before = len(hub.requests)
    cli = "import runpy; runpy.run_module('decoderlab.push', run_name='__main__')"
    command = [sys.executable, "-c", NETWORK_GUARD + "socket.getaddrinfo = _local_only\n" + cli]
    env = client_env(hub.url, tmp_path / "hf_home")
    result = subprocess.run([*command, str(folder), "decoderlab-org/no-token"], env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: No Hub token") and result.stderr.count("\n") == 1, result.stderr
    assert all(words in result.stderr for words in (hub.url, "hf auth login", "HF_TOKEN"))
    assert len(hub.requests) == requests_before
    assert sorted(p.name for p in folder.iterdir()) == before


def test_push_with_a_refused_token_names_the_endpoint_and_401(hub, checkpoint, tmp_path):
    """A token the Hub refuses: HubAccessError naming the endpoint, 401 and how to check the token; the card the
    push would write is not written."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], folder, ignore=shutil.ignore_patterns("checkpoint-*", "README.md"))
    with pytest.raises(HubAccessError, match=r"refused the token \(401 Unauthorized\).*hf auth whoami") as error:
        push_to_hub(folder, "decoderlab-org/refused", token="hf_not_a_valid_token")
    assert hub.url in str(error.value)
    assert not (folder / "README.md").exists()


def test_push_to_an_unreachable_hub_names_the_endpoint(hub, checkpoint, monkeypatch):
    """Nothing listening at the endpoint: one message naming its URL and what to check, not httpx's traceback."""
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(hub_constants, "ENDPOINT", closed)
    with pytest.raises(HubAccessError, match=rf"Cannot reach the Hub at {closed} .*HF_ENDPOINT"):
        push_to_hub(checkpoint[0], "decoderlab-org/unreachable", token=hub.token)


def test_push_in_offline_mode_says_so(hub, checkpoint, monkeypatch):
    """HF_HUB_OFFLINE=1 stops the push with a message naming it, not huggingface_hub's traceback."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubAccessError, match=r"Offline mode is on \(HF_HUB_OFFLINE=1\)"):
        push_to_hub(checkpoint[0], "decoderlab-org/offline", token=hub.token)


def edit_config(edit):
    """A breakage that edits a folder's config.json in place."""

    def apply(folder: pathlib.Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))

    return apply


def rename_auto_map_class(config: dict) -> None:
    config["auto_map"]["AutoModelForCausalLM"] = "modeling_decoderlab.DecoderLabForCausalLMv2"


def save_pickle(path: pathlib.Path) -> None:
    torch.save({"w": torch.zeros(2)}, path)


BREAKAGES = {  # name: (how to break a checkpoint folder, what the refusal must say)
    "no-config-code": (
        lambda f: (f / "configuration_decoderlab.py").unlink(), "configuration_decoderlab.py is missing"
    ),
    "no-model-code": (lambda f: (f / "modeling_decoderlab.py").unlink(), "modeling_decoderlab.py is missing"),
    "no-kernels-code": (
        lambda f: (f / "kernels_decoderlab.py").unlink(), "kernels_decoderlab.py is missing (imported by modeling"
    ),
    "no-compat-code": (
        lambda f: (f / "compat_decoderlab.py").unlink(), "compat_decoderlab.py is missing (imported by configuration"
    ),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), "no .safetensors weights"),
    "pickle": (lambda f: save_pickle(f / "pytorch_model.bin"), "pickle files would be uploaded: pytorch_model.bin"),
    "fake-safetensors": (lambda f: save_pickle(f / "model.safetensors"), "model.safetensors is not a safetensors"),
    "no-config": (lambda f: (f / "config.json").unlink(), "config.json is missing"),
    "no-auto-map": (edit_config(lambda c: c.pop("auto_map")), "lacks AutoConfig, AutoModel, AutoModelForCausalLM"),
    "partial-auto-map": (edit_config(lambda c: c["auto_map"].pop("AutoModel")), "auto_map lacks AutoModel "),
    "missing-class": (edit_config(rename_auto_map_class), "'modeling_decoderlab.DecoderLabForCausalLMv2', which is"),
    "missing-architecture": (edit_config(lambda c: c.update(architectures=["Nope"])), "architectures names"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_push_refuses_incomplete_checkpoints(hub, checkpoint, tmp_path, name):
    """A folder that would not load where decoderlab is missing, or would unpickle, is refused before any upload."""
    breakage, message = BREAKAGES[name]
    folder = tmp_path / "broken"
    shutil.copytree(checkpoint[0], folder, ignore=shutil.ignore_patterns("checkpoint-*"))
    breakage(folder)
    requests_before = len(hub.requests)
    with pytest.raises(ValueError, match="not a complete decoderlab checkpoint") as error:
        push_to_hub(folder, "decoderlab-org/broken", token=hub.token)
    assert message in str(error.value)
    assert len(hub.requests) == requests_before  # nothing was sent


@pytest.mark.parametrize("repo_id", ["no-namespace", "a/b/c", "org/bad name"])
def test_push_refuses_bad_repo_ids(checkpoint, repo_id):
    """repo_id must be ORG/NAME; the error names the value."""
    with pytest.raises(ValueError, match="must be 'ORG/NAME'"):
        push_to_hub(checkpoint[0], repo_id)


# ----------------------------------------------------------------------------------------------
# Pull


@pytest.mark.slow  # a fresh process importing torch and transformers
def test_pull_without_decoderlab_runs_pinned_remote_code(hub, pushed, reference, tmp_path):
    """Where decoderlab is not installed, AutoConfig/AutoModel/AutoModelForCausalLM/AutoTokenizer/pipeline load the
    repository through trust_remote_code at the pinned commit, and the model is the original, bit for bit."""
    repo_id, commit = pushed
    report, logits = pull(hub.url, repo_id, commit, reference, tmp_path / "pull", hide=True)
    assert not report["decoderlab_imported"]
    assert report["model_module"].startswith("transformers_modules.") and commit in report["model_module"]
    assert report["config_class"].endswith("configuration_decoderlab.DecoderLabConfig")
    assert_same_model(report, logits, reference)
    assert ("GET", f"/{repo_id}/resolve/{commit}/modeling_decoderlab.py") in hub.requests


@pytest.mark.slow  # a fresh process importing torch and transformers
def test_pull_with_decoderlab_installed_runs_no_remote_code(hub, pushed, reference, tmp_path):
    """With decoderlab imported, the Auto classes use the installed code, without trust_remote_code."""
    repo_id, _ = pushed
    report, logits = pull(hub.url, repo_id, "main", reference, tmp_path / "pull", hide=False)
    assert report["model_module"] == "decoderlab.modeling_decoderlab"
    assert report["config_class"] == "decoderlab.configuration_decoderlab.DecoderLabConfig"
    assert_same_model(report, logits, reference)


# The card's two "How to use" snippets: the section title, then the first Python block under it
CARD_SNIPPET = re.compile(
    r"^### (With decoderlab installed|Without decoderlab)[^\n]*\n.*?```python\n(.*?)```", re.M | re.S
)


@pytest.mark.slow  # two fresh processes, each loading the model from the test Hub and generating
def test_model_card_snippets_run_against_the_hub(hub, pushed, tmp_path):
    """The pushed card's snippets run as a reader would copy them, against the Hub (HF_ENDPOINT): with decoderlab
    importable, and without it (the commit hash filled in), where transformers must never stop to ask whether to
    run the repository's code (AutoTokenizer reads config.json, whose class is remote code)."""
    repo_id, commit = pushed
    card = hub.read(repo_id, commit, "README.md").decode()
    snippets = dict(CARD_SNIPPET.findall(card))
    assert set(snippets) == {"With decoderlab installed", "Without decoderlab"}
    without = snippets["Without decoderlab"].replace('"<commit-hash>"', f'"{commit}"')
    assert f'revision = "{commit}"' in without
    runs = {"with": snippets["With decoderlab installed"], "without": HIDE_DECODERLAB + without}
    for name, code in runs.items():
        guarded = NETWORK_GUARD + "socket.getaddrinfo = _local_only\n" + code
        result = subprocess.run(
            [sys.executable, "-c", guarded], env=client_env(hub.url, tmp_path / name), cwd=tmp_path,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, (name, result.stderr[-3000:])
        assert "Do you wish to run the custom code" not in result.stdout + result.stderr, name
    assert result.stdout.startswith("Once upon a time")  # the card's prompt, then the generated text


LOAD_BROKEN = """
import json, sys
from transformers import AutoModelForCausalLM

def errors(trust_remote_code):
    found = {}
    for repo in sys.argv[1:]:
        try:
            AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=trust_remote_code)
            found[repo] = None
        except Exception as err:
            found[repo] = f"{type(err).__name__}: {err}"
    return found

without_package = errors(trust_remote_code=True)
sys.meta_path.remove(next(f for f in sys.meta_path if type(f).__name__ == "HideDecoderlab"))
import decoderlab
print(json.dumps({"without": without_package, "with": errors(trust_remote_code=False)}))
"""


@pytest.mark.slow  # a fresh process importing torch and transformers
def test_loading_repositories_decoderlab_would_not_push(hub, checkpoint, tmp_path):
    """What a user sees loading hand-made repositories that decoderlab.push refuses (documented in the README):
    without auto_map, transformers does not recognize model type 'decoderlab'; an auto_map naming a missing class
    fails naming that class. Both repositories load once decoderlab is imported and no remote code is asked for."""
    api = HfApi(token=hub.token)
    repos = []
    for name in ("no-auto-map", "missing-class"):
        folder = tmp_path / name
        shutil.copytree(checkpoint[0], folder, ignore=shutil.ignore_patterns("checkpoint-*"))
        BREAKAGES[name][0](folder)
        repos.append(f"decoderlab-org/{name}")
        api.create_repo(repos[-1])
        api.upload_folder(folder_path=folder, repo_id=repos[-1])  # around decoderlab.push's checks
    env = client_env(hub.url, tmp_path / "hf_home")
    result = run_child(HIDE_DECODERLAB + LOAD_BROKEN, repos, env, tmp_path)
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    no_auto_map, missing_class = (errors["without"][repo] for repo in repos)
    assert no_auto_map.startswith("ValueError") and "model type `decoderlab`" in no_auto_map
    assert missing_class.startswith("AttributeError") and "DecoderLabForCausalLMv2" in missing_class
    assert errors["with"] == {repo: None for repo in repos}


# ----------------------------------------------------------------------------------------------
# olah: a Hub mirror we did not write, serving the same git repositories offline


@pytest.fixture
def olah(hub, tmp_path):
    """olah on 127.0.0.1 in offline mode, serving the test Hub's bare git repositories as local mirrors."""
    if not OLAH.exists():
        pytest.fail(f"olah is not installed at {OLAH}: run `make olah` (python3 -m venv .venv-olah && "
                    ".venv-olah/bin/pip install olah==0.5.4).")  # fmt: skip
    port = free_port()
    config = tmp_path / "olah.toml"
    config.write_text(
        textwrap.dedent(f"""\
        [basic]
        host = "127.0.0.1"
        port = {port}
        repos-path = "{tmp_path / "olah-cache"}"
        mirror-netloc = "127.0.0.1:{port}"
        mirror-lfs-netloc = "127.0.0.1:{port}"
        mirrors-path = ["{hub.root}"]

        [accessibility]
        offline = true
        """)
    )
    log = (tmp_path / "olah.log").open("w")
    command = [str(OLAH), "--config", str(config), "--log-path", str(tmp_path / "olah-logs")]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}/api/whoami-v2", timeout=1)
            break
        except urllib.error.HTTPError:  # any HTTP answer means olah is up
            break
        except OSError:  # not listening yet
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"olah did not start:\n{(tmp_path / 'olah.log').read_text()[-3000:]}")
            time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(timeout=30)
    log.close()


@pytest.mark.slow  # a fresh process importing torch and transformers
def test_pull_through_olah(hub, olah, pushed, reference, tmp_path):
    """olah, serving the pushed repository from its git directory, delivers a model that loads through
    trust_remote_code at the pinned commit and equals the original; the test Hub is not contacted."""
    repo_id, commit = pushed
    requests_before = len(hub.requests)
    report, logits = pull(olah, repo_id, commit, reference, tmp_path / "pull", hide=True)
    assert report["model_module"].startswith("transformers_modules.")
    assert_same_model(report, logits, reference)
    assert len(hub.requests) == requests_before
