"""Drives the playground page (GET / on the daemon's HTTP port) in Debian's headless Chromium
through Selenium, the way a person would use it, and checks what the page promises:

  - it loads with no console errors, and everything it loads comes from the daemon itself
    (the Content-Security-Policy says so, and the browser's resource list agrees);
  - a generation completes: the grid ends with every cell decided, the image is a PNG, and the
    NFE the page shows is the server's;
  - the grid animates: the canvas is captured on every animation frame while the image is drawn,
    and at least three distinct intermediate frames (neither the empty grid nor the final one)
    must be seen;
  - the race view runs the baseline (ar; mar for a continuous-token model) and the chosen method
    on the same request and reports both NFE counts the way they went: ar takes one forward
    per token and a speculative method fewer; mar a forward per iteration (several tokens
    each), and cspd, whose drafts the paper's rule rarely accepts, more (said as "more");
  - with --api-key (a daemon with --token-file): the page asks for the key before any API call,
    and works once it is typed in.

Run by E2eTest.PlaygroundAnimatesAndRacesInChromium against a daemon started with
--http-listen; by hand:

  python tests/e2e/playground_check.py --base-url http://127.0.0.1:8080 [--screenshot out.png]
      [--api-key TOKEN] [--model fmnist-t2i --prompt "a dark bag"]
      [--model fmnist-mar --method cspd --klass trouser]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

# Captures the first panel's grid canvas on every animation frame, keeping each distinct frame.
CAPTURE = """
window.__frames = [];
window.__capturing = true;
const grab = () => {
  const c = document.querySelector('#panels canvas.grid');
  if (c) {
    const d = c.toDataURL();
    if (window.__frames[window.__frames.length - 1] !== d) window.__frames.push(d);
  }
  if (window.__capturing) requestAnimationFrame(grab);
};
requestAnimationFrame(grab);
"""

# Cells of a panel's grid still showing the empty background (undecided tokens).
UNDECIDED = """
const panel = arguments[0], grid = arguments[1];
const c = panel.querySelector('canvas.grid'), ctx = c.getContext('2d'), cell = c.width / grid;
let n = 0;
for (let y = 0; y < grid; ++y) {
  for (let x = 0; x < grid; ++x) {
    const p = ctx.getImageData(Math.floor((x + 0.5) * cell), Math.floor((y + 0.5) * cell), 1, 1).data;
    if (p[0] === 0x20 && p[1] === 0x24 && p[2] === 0x28) ++n;
  }
}
return n;
"""


def fail(msg):
    print("FAIL playground: " + msg)
    sys.exit(1)


def browser(tmp):
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1280,900", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Chromium leaves its singleton socket's folder (org.chromium.Chromium.*) in TMPDIR after
    # every run: give it one of ours, removed after quit().
    return webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver",
                                                          env=dict(os.environ, TMPDIR=tmp)))


def wait_done(driver, panels, timeout):
    WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#panels .panel")) == panels and all(
            p.get_attribute("data-state") in ("done", "error")
            for p in d.find_elements(By.CSS_SELECTOR, "#panels .panel")))
    out = driver.find_elements(By.CSS_SELECTOR, "#panels .panel")
    for p in out:
        if p.get_attribute("data-state") != "done":
            fail("a panel ended in %s: %s" % (p.get_attribute("data-state"),
                                             p.find_element(By.CSS_SELECTOR, ".state").text))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="fmnist-gpt")
    ap.add_argument("--klass", default="sneaker", help="a class-conditional model's class")
    ap.add_argument("--prompt", default="a dark bag", help="a text-to-image model's prompt")
    ap.add_argument("--method", default="sjd")
    ap.add_argument("--seed", default="11")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--screenshot", default="")
    ap.add_argument("--api-key", default="", help="the daemon's token: typed into the page")
    args = ap.parse_args()
    base = args.base_url.rstrip("/")

    # The page's own headers: HTML, and a policy that allows this origin only.
    auth = {"Authorization": "Bearer " + args.api_key} if args.api_key else {}
    with urllib.request.urlopen(base + "/", timeout=30) as r:
        csp = r.headers.get("Content-Security-Policy", "")
        if not r.headers.get("Content-Type", "").startswith("text/html"):
            fail("GET / is %s" % r.headers.get("Content-Type"))
        if "default-src 'self'" not in csp:
            fail("GET / has no self-only Content-Security-Policy: %r" % csp)

    tmp = tempfile.mkdtemp(prefix="imagegen-chromium-")
    driver = browser(tmp)
    try:
        driver.get(base + "/")
        if args.api_key:
            WebDriverWait(driver, 60).until(
                lambda d: "needs an API key" in d.find_element(By.ID, "error").text)
            key = driver.find_element(By.ID, "key")
            key.send_keys(args.api_key)
            key.send_keys(Keys.TAB)  # the change event
        WebDriverWait(driver, 60).until(
            lambda d: len(Select(d.find_element(By.ID, "model")).options) > 0)
        Select(driver.find_element(By.ID, "model")).select_by_value(args.model)
        with urllib.request.urlopen(urllib.request.Request(base + "/v1/models", headers=auth),
                                    timeout=30) as r:
            info = next(m for m in json.load(r)["data"] if m["id"] == args.model)["imagegen"]
        grid = info["grid"]
        baseline = "mar" if info["default_method"] == "mar" else "ar"
        if info["prompted"]:
            prompt = driver.find_element(By.ID, "prompt")
            prompt.clear()
            prompt.send_keys(args.prompt)
        else:
            Select(driver.find_element(By.ID, "class")).select_by_value(args.klass)
        Select(driver.find_element(By.ID, "method")).select_by_value(args.method)
        seed = driver.find_element(By.ID, "seed")
        seed.clear()
        seed.send_keys(args.seed)

        # One generation, captured frame by frame.
        driver.execute_script(CAPTURE)
        t0 = time.time()
        driver.find_element(By.ID, "generate").click()
        (panel,) = wait_done(driver, 1, args.timeout)
        driver.execute_script("window.__capturing = false;")
        frames = driver.execute_script("return window.__frames;")
        undecided = driver.execute_script(UNDECIDED, panel, grid)
        nfe = int(panel.get_attribute("data-nfe"))
        shown = int(panel.find_element(By.CSS_SELECTOR, ".nfe").text)
        src = panel.find_element(By.CSS_SELECTOR, "img.image").get_attribute("src")
        print("generate: %s, %d forwards for %d tokens in %.1f s; %d distinct grid frames captured"
              % (args.method, nfe, grid * grid, time.time() - t0, len(frames)))
        if undecided != 0:
            fail("%d cells of the final grid are undecided" % undecided)
        if not src.startswith("data:image/png;base64,iVBOR"):
            fail("the image is not a PNG: %s..." % src[:40])
        if shown != nfe or not 0 < nfe <= grid * grid:
            fail("NFE shown %d, the server's %d" % (shown, nfe))
        # Intermediate frames: neither the empty grid (the first capture) nor the final one.
        final = driver.execute_script(
            "return arguments[0].querySelector('canvas.grid').toDataURL();", panel)
        intermediate = [f for f in frames[1:] if f != final]
        if len(set(intermediate)) < 3:
            fail("the grid did not animate: %d intermediate frames" % len(set(intermediate)))
        print("animation: %d distinct intermediate frames (the page draws one step per frame; "
              "%d steps)" % (len(set(intermediate)), nfe))

        # The race: the baseline and the speculative method on the same request.
        driver.find_element(By.ID, "race").click()
        panels = wait_done(driver, 2, args.timeout)
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.ID, "race-summary").is_displayed())
        summary = driver.find_element(By.ID, "race-summary")
        base_nfe = int(summary.get_attribute("data-baseline-nfe"))
        spec_nfe = int(summary.get_attribute("data-speculative-nfe"))
        methods = [p.get_attribute("data-method") for p in panels]
        print("race: %s %d forwards, %s %d forwards: %s" % (methods[0], base_nfe, methods[1],
                                                          spec_nfe, summary.text))
        if methods != [baseline, args.method]:
            fail("the race ran %s" % methods)
        if baseline == "ar":
            if base_nfe != grid * grid:
                fail("ar took %d forwards for %d tokens" % (base_nfe, grid * grid))
            if not 0 < spec_nfe < base_nfe:
                fail("%s took %d forwards, ar %d" % (args.method, spec_nfe, base_nfe))
        elif not 0 < base_nfe < grid * grid:  # mar: several tokens per iteration
            fail("mar took %d forwards for %d tokens" % (base_nfe, grid * grid))
        if str(base_nfe) not in summary.text or str(spec_nfe) not in summary.text:
            fail("the summary does not give both counts: %s" % summary.text)
        way = "fewer" if spec_nfe < base_nfe else "more" if spec_nfe > base_nfe else "as many"
        if (way + " forward passes") not in summary.text:
            fail("the summary says it the wrong way round (%s took %s): %s"
                 % (args.method, way, summary.text))
        for p in panels:
            if int(p.find_element(By.CSS_SELECTOR, ".nfe").text) != int(p.get_attribute("data-nfe")):
                fail("a race panel shows another NFE than the server's")
        same = summary.get_attribute("data-same-image")
        if args.method != "ar-gm" and same != "false":
            fail("%s and %s drew the same image (%s)" % (methods[0], methods[1], same))

        # The match rule: scd-gm races ar-gm, on one seed, and draws its very image.
        if "scd-gm" in info["methods"] and "ar-gm" in info["methods"]:
            Select(driver.find_element(By.ID, "method")).select_by_value("scd-gm")
            race = driver.find_element(By.ID, "race")
            if race.text != "Race against ar-gm":
                fail("the race button says %r for scd-gm" % race.text)
            race.click()
            panels = wait_done(driver, 2, args.timeout)
            WebDriverWait(driver, 30).until(
                lambda d: d.find_element(By.ID, "race-summary").is_displayed())
            summary = driver.find_element(By.ID, "race-summary")
            methods = [p.get_attribute("data-method") for p in panels]
            base_nfe = int(summary.get_attribute("data-baseline-nfe"))
            spec_nfe = int(summary.get_attribute("data-speculative-nfe"))
            print("race: %s %d forwards, %s %d forwards: %s" % (methods[0], base_nfe, methods[1],
                                                              spec_nfe, summary.text))
            if methods != ["ar-gm", "scd-gm"]:
                fail("the match rule's race ran %s" % methods)
            if summary.get_attribute("data-same-image") != "true" or \
                    "same image" not in summary.text:
                fail("scd-gm did not draw ar-gm's image: %s" % summary.text)
            if not 0 < spec_nfe < base_nfe == grid * grid:
                fail("scd-gm took %d forwards, ar-gm %d" % (spec_nfe, base_nfe))

        # Everything the page loaded came from the daemon.
        foreign = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
            ".filter(n => !n.startsWith(location.origin + '/') && !n.startsWith('data:'));")
        if foreign:
            fail("the page loaded other origins: %s" % foreign)
        if args.screenshot:
            driver.save_screenshot(args.screenshot)
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        if errors:
            fail("console errors: %s" % errors)
        print("console: no errors; every resource from %s" % base)
    finally:
        driver.quit()
        shutil.rmtree(tmp, ignore_errors=True)
    print("playground: ok")


if __name__ == "__main__":
    main()
