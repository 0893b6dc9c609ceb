"""Classify generated Fashion-MNIST PNGs with the bundled classifier (models/fmnist-classifier).

Prints "<file> <class id> <class name> <probability>" per file; with --expect NAME|ID exits 1
unless every file is of that class. The PNG may be upscaled (imagegen --scale): it is reduced to
28x28 by averaging blocks. Used by deploy/test-image.sh, which has no test binary to hand.

  python tools/classify_png.py --expect sneaker sneaker.png
"""
import argparse
import os
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from imagegen_ref import Classifier, load_config, load_tensors  # noqa: E402


def main(argv=None) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("png", nargs="+")
    ap.add_argument("--classifier", default=os.path.join(root, "models", "fmnist-classifier"))
    ap.add_argument("--expect", default="", help="class name or id every file must be")
    args = ap.parse_args(argv)

    cfg = load_config(args.classifier)
    names = cfg["class_names"]
    net = Classifier(cfg["width"], cfg["features"], cfg["num_classes"])
    sd = {k: v for k, v in load_tensors(args.classifier).items() if not k.startswith("reference.")}
    net.load_state_dict(sd, strict=True)
    net.eval()
    expect = None
    if args.expect:
        expect = int(args.expect) if args.expect.isdigit() else names.index(args.expect)

    ok = True
    for path in args.png:
        img = np.asarray(Image.open(path).convert("L"), dtype=np.float64)
        h, w = img.shape
        if h % 28 or w % 28 or h != w:
            print(f"{path}: {w}x{h} is not a square multiple of 28x28", file=sys.stderr)
            return 2
        s = h // 28
        small = img.reshape(28, s, 28, s).mean(axis=(1, 3))
        x = torch.tensor(small, dtype=torch.float32).div(255.0).view(1, 1, 28, 28)
        with torch.no_grad():
            p = torch.softmax(net(x), dim=1)[0]
        k = int(p.argmax())
        print(f"{path} {k} {names[k]} {float(p[k]):.3f}")
        ok &= expect is None or k == expect
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
