#!/usr/bin/env python3
"""The official `openai` package, unmodified apart from base_url and api_key, against imagegen's
HTTP API (issue 18). Run by E2eTest.OpenAiSdkDrawsStreamsAndRaisesItsErrors against a daemon
serving fmnist-gpt and fmnist-t2i; exits non-zero with a message on the first failed check.

  api        models.list; images.generate with n = 1 and 4 (b64_json, a size, imagegen's own
             options through extra_body); a stream with partial images; the SDK's errors:
             BadRequestError naming the parameter, NotFoundError, AuthenticationError; then two
             clients hang up: a stream after its first partial image, and a request for 16
             images just after sending it (the test then sees both cancelled, slots free)
  ratelimit  on a daemon with 2 KV slots and a queue of 1: one image runs, more arrive at once,
             and the SDK raises RateLimitError (max_retries=0) for those the queue cannot take
"""
import argparse
import base64
import http.client
import io
import json
import sys
import threading
import time
import urllib.parse

import openai
from PIL import Image


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


def png(b64):
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def api(client, bad_client):
    ids = [m.id for m in client.models.list().data]
    check(ids == ["fmnist-gpt", "fmnist-t2i"], f"models.list gives the loaded models: {ids}")

    r = client.images.generate(model="fmnist-gpt", prompt="sneaker", response_format="b64_json",
                               extra_body={"seed": 7, "method": "scd-mc"})
    check(len(r.data) == 1, "n = 1: one image")
    check(png(r.data[0].b64_json).size == (28, 28), "the model's own size")
    stats = r.data[0].model_extra["imagegen"]
    check(stats["seed"] == 7 and stats["method"] == "scd-mc" and stats["class_id"] == 7,
          f"the options are echoed: {stats}")
    check(stats["nfe"] < 196, f"it speculated: NFE {stats['nfe']}")
    print(f"n=1: sneaker, seed 7, NFE {stats['nfe']}, step compression "
          f"{stats['step_compression']:.2f}, acceptance {stats['acceptance_rate']:.2f}")

    r = client.images.generate(model="fmnist-t2i", prompt="a sandal", n=4, size="56x56",
                               extra_body={"seed": 40})
    check(len(r.data) == 4, f"n = 4: {len(r.data)} images")
    seeds = [d.model_extra["imagegen"]["seed"] for d in r.data]
    check(seeds == [40, 41, 42, 43], f"image i has seed + i: {seeds}")
    check(all(png(d.b64_json).size == (56, 56) for d in r.data), "size 56x56")
    check(len({d.b64_json for d in r.data}) == 4, "four different images")
    check(r.usage is not None and r.usage.output_tokens == 4 * 196,
          f"usage counts the image tokens: {r.usage}")
    prefills = [d.model_extra["imagegen"]["prefill_forwards"] for d in r.data]
    print(f"n=4: seeds {seeds}, prefill forwards {prefills}, usage {r.usage.output_tokens} tokens")

    events = list(client.images.generate(model="fmnist-t2i", prompt="a bag", stream=True,
                                         partial_images=2,
                                         extra_body={"seed": 3, "method": "ar"}))
    types = [e.type for e in events]
    check(types == ["image_generation.partial_image"] * 2 + ["image_generation.completed"],
          f"two partial images, then the image: {types}")
    check([e.partial_image_index for e in events[:2]] == [0, 1], "partial indices 0, 1")
    frames = [png(e.b64_json).tobytes() for e in events]
    check(len(set(frames)) == 3, "each partial image shows more of the grid")
    check(events[-1].usage.output_tokens == 196, "the completed event carries usage")
    print(f"stream: {types}")

    def raises(kind, param, **kw):
        try:
            client.images.generate(**kw)
        except kind as e:
            check(param is None or e.param == param, f"{kind.__name__} names {param}: {e.param}")
            print(f"{kind.__name__} ({e.status_code}) param {e.param}: {e.message}")
            return
        sys.exit(f"FAILED: {kw} did not raise {kind.__name__}")

    raises(openai.BadRequestError, "top_p", model="fmnist-gpt", prompt="coat",
           extra_body={"top_p": 3})
    raises(openai.BadRequestError, "size", model="fmnist-gpt", prompt="coat", size="1024x1024")
    raises(openai.BadRequestError, "prompt", model="fmnist-gpt", prompt="a unicorn")
    raises(openai.BadRequestError, "n", model="fmnist-t2i", prompt="a bag", n=99)
    raises(openai.BadRequestError, "response_format", model="fmnist-gpt", prompt="coat",
           response_format="url")
    raises(openai.NotFoundError, "model", model="dall-e-3", prompt="coat")
    try:
        bad_client.images.generate(model="fmnist-gpt", prompt="coat")
        sys.exit("FAILED: a wrong API key was accepted")
    except openai.AuthenticationError as e:
        print(f"AuthenticationError ({e.status_code})")


def ratelimit(client):
    # The first image holds both KV slots (method ar: 196 steps); it is running once its first
    # partial image (after 22 tokens) arrives.
    stream = client.images.generate(model="fmnist-gpt", prompt="coat", stream=True,
                                    partial_images=8, extra_body={"seed": 5, "method": "ar"})
    first = next(iter(stream))
    check(first.type == "image_generation.partial_image", "the first image is running")
    outcomes = []

    def one(seed):
        try:
            client.images.generate(model="fmnist-gpt", prompt="coat",
                                   extra_body={"seed": seed, "method": "ar"})
            outcomes.append("ok")
        except openai.RateLimitError as e:
            retry = e.response.headers.get("retry-after")
            check(retry is not None and int(retry) >= 1, f"Retry-After: {retry}")
            outcomes.append("429")

    threads = [threading.Thread(target=one, args=(10 + i,)) for i in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rest = list(stream)
    check(rest and rest[-1].type == "image_generation.completed", "the first image completes")
    check(outcomes.count("429") >= 1, f"the full queue raises RateLimitError: {outcomes}")
    print(f"7 requests beside a running one, queue of 1: {outcomes.count('429')} RateLimitError, "
          f"{outcomes.count('ok')} ok")


def disconnect(client, base_url, api_key):
    # A stream hangs up after its first partial image (22 of 196 tokens, one a step: it cannot
    # finish in the moment between).
    stream = client.images.generate(model="fmnist-gpt", prompt="dress", stream=True,
                                    partial_images=8, extra_body={"seed": 6, "method": "ar"})
    first = next(iter(stream))
    check(first.type == "image_generation.partial_image", "the stream is running")
    stream.close()
    # A request for 16 images (196 steps of 16 images) hangs up 50 ms after sending it; the
    # server's watchdog looks at waiting connections every 100 ms.
    url = urllib.parse.urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", url.path + "/images/generations",
                 json.dumps({"model": "fmnist-gpt", "prompt": "dress", "method": "ar", "n": 16}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    time.sleep(0.05)
    conn.close()
    print("a stream and a request for 16 images hung up")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--mode", choices=["api", "ratelimit"], required=True)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                           timeout=120)
    if args.mode == "api":
        bad = openai.OpenAI(base_url=args.base_url, api_key="wrong", max_retries=0, timeout=120)
        api(client, bad)
        disconnect(client, args.base_url, args.api_key)
    else:
        ratelimit(client)
    print("OK")


if __name__ == "__main__":
    main()
