// The imagegen playground: one page, no build step, no dependencies. It calls the daemon's
// OpenAI-style Images API (POST /v1/images/generations) with stream: true and imagegen's
// stream_steps: true, and draws each imagegen.step event as it comes: the cells that step
// decided, coloured by the step. Steps are drawn one per animation frame, so that a fast
// generation still shows every step.
'use strict';

const $ = (id) => document.getElementById(id);
const state = { models: [], running: false };

function headers() {
  const h = { 'Content-Type': 'application/json' };
  const key = $('key').value.trim();
  if (key) h.Authorization = 'Bearer ' + key;
  return h;
}

function showError(message) {
  const e = $('error');
  e.textContent = message;
  e.hidden = !message;
}

async function apiError(response) {
  try {
    const body = await response.json();
    if (body && body.error) {
      return body.error.message + (body.error.param ? ' (parameter: ' + body.error.param + ')' : '');
    }
  } catch (_) { /* not JSON */ }
  return 'HTTP ' + response.status;
}

// --- the models ---------------------------------------------------------------------------

// A server with a token: the page asks for the key before its first API call, so that an
// unauthenticated call (and the browser's console error for its 401) happens only for a
// wrong key.
async function loadModels() {
  if (state.authRequired === undefined) {
    const config = await fetch('/playground/config');
    state.authRequired = config.ok && (await config.json()).auth_required;
  }
  if (state.authRequired && !$('key').value.trim()) {
    showError('This server needs an API key: enter it above.');
    $('key').focus();
    return;
  }
  const response = await fetch('/v1/models', { headers: headers() });
  if (response.status === 503) {  // loading its models (or draining): ask again
    showError('The server is not ready (' + await apiError(response) + '); retrying.');
    setTimeout(() => loadModels().catch((e) => showError('Cannot reach the server: ' + e.message)),
               1000);
    return;
  }
  if (!response.ok) {
    showError(response.status === 401 ? 'The API key was refused: enter the server\'s key above.'
                                      : 'Cannot list the models: ' + await apiError(response));
    return;
  }
  showError('');
  state.models = (await response.json()).data;
  const select = $('model');
  select.replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
  $('server-info').textContent = state.models.length + ' model(s) loaded.';
  modelChanged();
}

function currentModel() {
  return state.models.find((m) => m.id === $('model').value);
}

function modelChanged() {
  const m = currentModel();
  if (!m) return;
  const info = m.imagegen;
  const methods = $('method');
  methods.replaceChildren(...info.methods.map((x) => new Option(x, x)));
  // The default speculative method, or the first one that is not the baseline.
  const spec = info.methods.includes(info.default_method) && info.default_method !== info.methods[0]
    ? info.default_method : (info.methods[1] || info.methods[0]);
  methods.value = spec;
  $('prompt-field').hidden = !info.prompted;
  $('class-field').hidden = info.prompted;
  if (info.prompted) {
    if (!$('prompt').value) $('prompt').value = 'a pair of trousers';
  } else {
    $('class').replaceChildren(...info.classes.map((c) => new Option(c, c)));
  }
  $('cfg').value = info.sampling_defaults.cfg_scale;
  methodChanged();
}

// The method a race runs beside the chosen one: the model's baseline (its first method), or
// for a method of the match rule (scd-gm) ar-gm, which draws the same image for the seed
// (docs/decoding.md, "The match rule").
function raceMethods() {
  const methods = currentModel().imagegen.methods;
  const first = methods[0];
  let spec = $('method').value;
  if (spec === first) spec = methods.find((x) => x !== first) || first;
  const match = spec.endsWith('-gm') && spec !== 'ar-gm' && methods.includes('ar-gm');
  return [match ? 'ar-gm' : first, spec];
}

function methodChanged() {
  if (currentModel()) $('race').textContent = 'Race against ' + raceMethods()[0];
}

// --- one panel: a request drawn as it streams ----------------------------------------------

// The colour of a step: hues spaced by the golden angle, so neighbouring steps differ; steps
// that decided one cell are pale, bursts are saturated.
function stepColour(step, burst) {
  const hue = (step * 137.508) % 360;
  return burst > 1 ? `hsl(${hue} 80% 55%)` : `hsl(${hue} 25% 62%)`;
}

class Panel {
  constructor(method, grid) {
    const node = $('panel-template').content.firstElementChild.cloneNode(true);
    this.node = node;
    this.method = method;
    this.grid = grid;
    this.queue = [];
    this.canvas = node.querySelector('canvas.grid');
    this.canvas.width = this.canvas.height = Math.max(1, Math.floor(256 / grid)) * grid;
    this.ctx = this.canvas.getContext('2d');
    node.querySelector('.title').textContent = method;
    node.dataset.method = method;
    node.dataset.state = 'waiting';
    this.clear();
    $('panels').append(node);
  }

  clear() {
    this.ctx.fillStyle = '#202428';
    this.ctx.fillRect(0, 0, this.canvas.width, this.canvas.height);
  }

  set(cls, text) { this.node.querySelector('.' + cls).textContent = text; }

  setState(s, text) {
    this.node.dataset.state = s;
    this.set('state', text);
  }

  // Applies queued events up to and including the next step; false when none is left.
  drawNext() {
    while (this.queue.length > 0) {
      const ev = this.queue.shift();
      this.apply(ev);
      if (ev.type === 'imagegen.step') return true;
    }
    return false;
  }

  apply(ev) {
    if (ev.type === 'imagegen.step') {
      const cell = this.canvas.width / this.grid;
      const burst = ev.positions.length;
      this.ctx.fillStyle = stepColour(ev.step, burst);
      for (const p of ev.positions) {
        const x = p % this.grid, y = Math.floor(p / this.grid);
        this.ctx.fillRect(x * cell + 1, y * cell + 1, cell - 2, cell - 2);
      }
      this.set('nfe', ev.nfe);
      this.set('committed', ev.committed + ' / ' + ev.total);
      this.set('acceptance', ev.drafts_verified > 0
        ? (100 * ev.drafts_accepted / ev.drafts_verified).toFixed(1) + '%' : '-');
      this.set('compression', (ev.committed / Math.max(ev.nfe, 1)).toFixed(2));
      this.set('burst', burst + (burst === 1 ? ' token' : ' tokens') + ' (window ' + ev.window + ')');
      this.node.dataset.nfe = ev.nfe;
      this.setState('streaming', 'step ' + ev.step);
    } else if (ev.type === 'image_generation.partial_image') {
      this.node.querySelector('img.image').src = 'data:image/png;base64,' + ev.b64_json;
      this.set('image-caption', 'partial image ' + (ev.partial_image_index + 1));
    } else if (ev.type === 'image_generation.completed') {
      const s = ev.imagegen;
      this.stats = s;
      this.png = ev.b64_json;
      this.node.querySelector('img.image').src = 'data:image/png;base64,' + ev.b64_json;
      this.set('image-caption', 'image');
      this.set('nfe', s.nfe);
      this.node.dataset.nfe = s.nfe;
      this.setState('done', `done: ${s.nfe} forwards, ${(1000 * s.generation_seconds).toFixed(0)} ms ` +
                            `(${s.policy}, seed ${s.seed})`);
    } else if (ev.type === 'error') {
      this.setState('error', 'error: ' + ev.error.message);
      showError(ev.error.message);
    }
  }
}

// The animation: each frame, every panel draws its next step.
let animating = false;
function animate(panels) {
  if (animating) return;
  animating = true;
  const frame = () => {
    let more = false;
    for (const p of panels) more = p.drawNext() || more;
    if (more || state.running) {
      requestAnimationFrame(frame);
    } else {
      animating = false;
    }
  };
  requestAnimationFrame(frame);
}

// Server-sent events from a fetch response (EventSource cannot POST).
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let data = '';
      for (const line of block.split('\n')) {
        if (line.startsWith('data:')) data += line.slice(5).trimStart();
      }
      if (data) yield JSON.parse(data);
    }
  }
}

function requestBody(method, seed) {
  const m = currentModel();
  const body = {
    model: m.id,
    prompt: m.imagegen.prompted ? $('prompt').value : $('class').value,
    method,
    stream: true,
    stream_steps: true,
    partial_images: 3,
  };
  if (seed !== undefined) body.seed = seed;
  const cfg = parseFloat($('cfg').value);
  if (Number.isFinite(cfg)) body.cfg_scale = cfg;
  return body;
}

async function run(panel, seed) {
  panel.setState('streaming', 'queued');
  const response = await fetch('/v1/images/generations', {
    method: 'POST', headers: headers(), body: JSON.stringify(requestBody(panel.method, seed)),
  });
  if (!response.ok) {
    const message = await apiError(response);
    panel.setState('error', 'error: ' + message);
    showError(message);
    return;
  }
  for await (const ev of events(response)) panel.queue.push(ev);
}

async function start(methods) {
  if (state.running || !currentModel()) return;
  showError('');
  state.running = true;
  $('generate').disabled = $('race').disabled = true;
  $('panels').replaceChildren();
  $('race-summary').hidden = true;
  const grid = currentModel().imagegen.grid;
  const panels = methods.map((m) => new Panel(m, grid));
  // The seed field's, else one drawn here: a race's two requests share it.
  let seed = parseInt($('seed').value, 10);
  if (!(Number.isFinite(seed) && seed >= 0)) {
    seed = methods.length > 1 ? Math.floor(Math.random() * 2147483647) : undefined;
  }
  animate(panels);
  try {
    await Promise.all(panels.map((p) => run(p, seed).catch((e) => {
      p.setState('error', 'error: ' + e.message);
      showError(e.message);
    })));
  } finally {
    state.running = false;
    $('generate').disabled = $('race').disabled = false;
  }
  // The race's verdict once both are drawn.
  await new Promise((resolve) => {
    const wait = () => (panels.some((p) => p.queue.length > 0) ? requestAnimationFrame(wait) : resolve());
    wait();
  });
  if (panels.length === 2 && panels.every((p) => p.stats)) raceSummary(panels[0], panels[1]);
}

function raceSummary(base, spec) {
  const s = $('race-summary');
  const b = base.stats.nfe, x = spec.stats.nfe;
  s.dataset.baselineNfe = b;
  s.dataset.speculativeNfe = x;
  s.replaceChildren();
  const strong = (t) => Object.assign(document.createElement('strong'), { textContent: t });
  // Said the way it went: a method that took more forwards than the baseline (cspd against
  // mar, whose drafts the paper's rule rarely accepts) is not "0.33x fewer".
  const verdict = x < b ? `${(b / Math.max(x, 1)).toFixed(2)}x fewer forward passes`
                : x > b ? `${(x / Math.max(b, 1)).toFixed(2)}x more forward passes`
                        : 'as many forward passes';
  s.dataset.verdict = x < b ? 'fewer' : x > b ? 'more' : 'same';
  s.append(strong(spec.method), ` drew its image in ${x} forwards, `, strong(base.method),
           ` in ${b}: ${verdict} ` +
           `(${(1000 * spec.stats.generation_seconds).toFixed(0)} ms against ` +
           `${(1000 * base.stats.generation_seconds).toFixed(0)} ms, both in one batch).`);
  // One seed: the match rule draws the baseline's very image (other methods another one).
  const same = base.png !== undefined && base.png === spec.png;
  s.dataset.sameImage = same ? 'true' : 'false';
  if (same) s.append(' Both drew the same image, pixel for pixel.');
  s.hidden = false;
}

// --- wiring ------------------------------------------------------------------------------

document.addEventListener('DOMContentLoaded', () => {
  $('key').value = localStorage.getItem('imagegen.key') || '';
  $('key').addEventListener('change', () => {
    localStorage.setItem('imagegen.key', $('key').value.trim());
    loadModels().catch((e) => showError('Cannot reach the server: ' + e.message));
  });
  $('model').addEventListener('change', modelChanged);
  $('controls').addEventListener('submit', (e) => {
    e.preventDefault();
    start([$('method').value]);
  });
  $('method').addEventListener('change', methodChanged);
  $('race').addEventListener('click', () => {
    if (!currentModel()) return;
    start(raceMethods());
  });
  loadModels().catch((e) => showError('Cannot reach the server: ' + e.message));
});
