"""Write this example's weights into a directory: ``python make_weights.py OUT_DIR``.

Creates ``tiny.pth`` (state dict, for eager mode with model.py) and ``tiny_scripted.pt``
(TorchScript, for the no-modelFile path). Deterministic: seeded, so tests can compare outputs.
"""

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import TinyClassifier  # noqa: E402


def make(out_dir: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyClassifier().eval()
    state_path, script_path = out / "tiny.pth", out / "tiny_scripted.pt"
    torch.save(model.state_dict(), state_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated, still supported
        torch.jit.script(model).save(str(script_path))
    return state_path, script_path


if __name__ == "__main__":
    for path in make(sys.argv[1] if len(sys.argv) > 1 else "."):
        print(path)
