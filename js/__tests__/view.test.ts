/**
 * The one view base (view.ts): the lifecycle every view shares, checked once on a bare view
 * and then on each of the three real ones (grid, circuit, feature circuit).
 *
 * happy-dom's ResizeObserver never calls back, so these tests install one that records what
 * it observes and is fired by hand (`fire`): what a browser does when the root's width
 * changes. Real resizing in Chromium is the e2e tests' (tests/e2e).
 */
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { CircuitView } from '../circuit';
import { normalizeState, type GridState } from '../data';
import { FeatureView } from '../features';
import { GridView } from '../grid';
import { StopButton, View, type GridCallbacks } from '../view';
import { circuitState, f32spec, featureState } from './helpers';

/** A ResizeObserver that keeps what it was told, fired by the test. */
class RecordingObserver {
  static made: RecordingObserver[] = [];
  observed: Element[] = [];
  disconnected = false;
  constructor(private callback: ResizeObserverCallback) {
    RecordingObserver.made.push(this);
  }
  observe(el: Element): void {
    this.observed.push(el);
  }
  unobserve(): void {}
  disconnect(): void {
    this.disconnected = true;
  }
  fire(): void {
    if (!this.disconnected) this.callback([], this as unknown as ResizeObserver);
  }
}

/** One animation frame (the base draws again on the next one after a resize). */
const frame = () => new Promise<void>((resolve) => requestAnimationFrame(() => resolve()));

/** The least a view is: a width the test sets, a count of renders, one button. */
class BareView extends View {
  renders = 0;
  width = 500;
  clicks = 0;
  readonly body = document.createElement('div');
  readonly button = document.createElement('button');
  readonly stop = new StopButton('stop', () => this.cb.onStop?.(), this.signal);
  constructor(el: HTMLElement, cb: GridCallbacks = {}) {
    super(el, cb, 'pipatch-bare');
    this.toolbar.append(this.button, this.stop.button);
    this.listen(this.button, 'click', () => this.clicks++);
    this.mount(el, [this.body], [document.createElement('span')]);
  }
  protected availWidth(): number {
    return this.width;
  }
  protected render(): void {
    this.renders++;
    this.measure();
    this.renderFrame(this.state!, `drawn ${this.renders}`);
  }
}

function gridState(extra: Record<string, unknown> = {}): GridState {
  return normalizeState({
    title: 'Grid', kind: 'trace', model_name: 'tiny', metric: 'p', views: ['resid', 'mlp'], row_labels: ['0', '1'], col_labels: ['a', 'b'],
    baselines: { clean: 0.5, corrupt: 0.1 }, status: 'running', stoppable: true, warnings: ['careful'],
    arrays: { 'resid/mean': f32spec([0.1, 0.2, 0.3, 0.4], [2, 2]) }, ...extra,
  });
}

function host(): HTMLElement {
  const el = document.createElement('div');
  document.body.appendChild(el);
  return el;
}

beforeEach(() => {
  RecordingObserver.made = [];
  vi.stubGlobal('ResizeObserver', RecordingObserver);
});
afterEach(() => {
  vi.unstubAllGlobals();
  vi.restoreAllMocks();
  document.body.replaceChildren();
});

describe('View (the base)', () => {
  it('mounts one root: header, toolbar, status, warnings, errors, its body, detail, hidden tooltip', () => {
    const el = host();
    const v = new BareView(el);
    expect(el.children).toHaveLength(1);
    expect(v.root.className).toBe('pipatch-grid pipatch-bare');
    expect(v.root.getAttribute('data-status')).toBe('loading');
    const kids = Array.from(v.root.children).map((c) => c.className);
    expect(kids).toEqual(['pipatch-header', 'pipatch-toolbar', 'pipatch-status', 'pipatch-warnings', 'pipatch-errors', '', 'pipatch-detail', 'pipatch-tooltip']);
    expect(v.root.children[5]).toBe(v.body);
    expect(Array.from(v.root.children[0].children).map((c) => c.className)).toEqual(['pipatch-title', 'pipatch-subtitle', '']);
    expect((v.root.querySelector('.pipatch-tooltip') as HTMLElement).style.display).toBe('none');
    expect(RecordingObserver.made).toHaveLength(1);
    expect(RecordingObserver.made[0].observed).toEqual([v.root]);
    expect(v.renders).toBe(0); // nothing is drawn before the first state
  });

  it('draws once per update: the frame, and the UI choices merged (an unknown view falls back)', () => {
    const v = new BareView(host());
    v.update(gridState(), { view: 'nope', seed: 1 });
    expect(v.renders).toBe(1);
    expect(v.root.getAttribute('data-status')).toBe('running');
    expect(v.root.querySelector('.pipatch-title')!.textContent).toBe('Grid');
    expect(v.root.querySelector('.pipatch-subtitle')!.textContent).toBe('trace · tiny · metric: p · clean 0.500, corrupt 0.100');
    expect(v.root.querySelector('.pipatch-status')!.textContent).toBe('drawn 1');
    expect(v.root.querySelector('.pipatch-status')!.getAttribute('data-status')).toBe('running');
    expect(v.root.querySelector('.pipatch-warnings')!.textContent).toBe('⚠ careful');
    expect((v as unknown as { ui: { view: string; seed: number } }).ui).toMatchObject({ view: 'resid', seed: 1 });
    v.update(gridState({ warnings: [] }), { view: 'mlp' });
    expect(v.renders).toBe(2);
    expect((v as unknown as { ui: { view: string } }).ui.view).toBe('mlp');
    expect((v.root.querySelector('.pipatch-warnings') as HTMLElement).style.display).toBe('none');
    v.setErrors(['bad <b>array</b>']);
    expect(Array.from(v.root.querySelectorAll('.pipatch-error')).map((e) => e.textContent)).toEqual(['bad <b>array</b>']);
    expect(v.root.querySelector('b')).toBeNull();
  });

  it('draws again, once on the next frame, when the width to draw at moves by more than 4 px', async () => {
    const v = new BareView(host());
    const obs = RecordingObserver.made[0];
    obs.fire();
    await frame();
    expect(v.renders).toBe(0); // no state yet: nothing to draw
    v.update(gridState());
    v.width = 503;
    obs.fire();
    await frame();
    expect(v.renders).toBe(1); // 3 px: not worth a redraw
    v.width = 700;
    obs.fire();
    obs.fire();
    obs.fire();
    expect(v.renders).toBe(1); // not inside the observer's callback
    await frame();
    expect(v.renders).toBe(2); // three notices, one redraw
    obs.fire();
    await frame();
    expect(v.renders).toBe(2); // drawn at 700 now
  });

  it('destroy disconnects the observer, removes the listeners and the root, and cancels a pending redraw', async () => {
    const el = host();
    let stopped = 0;
    const v = new BareView(el, { onStop: () => stopped++ });
    v.update(gridState());
    v.button.click();
    v.stop.update(gridState());
    v.stop.button.click();
    expect([v.clicks, stopped]).toEqual([1, 1]);
    v.width = 900;
    RecordingObserver.made[0].fire(); // a redraw is pending...
    v.destroy();
    await frame();
    expect(v.renders).toBe(1); // ...and never happens
    expect(RecordingObserver.made[0].disconnected).toBe(true);
    expect(el.children).toHaveLength(0);
    v.button.click();
    v.stop.button.click();
    expect([v.clicks, stopped]).toEqual([1, 1]); // no listener is left
  });
});

describe('StopButton', () => {
  it('shows while running and stoppable, asks once, and resets when the run ends', () => {
    let asked = 0;
    const b = new StopButton('stop it', () => asked++);
    expect([b.button.className, b.button.title, b.button.type, b.button.textContent]).toEqual(['pipatch-stop', 'stop it', 'button', 'Stop']);
    b.update(gridState({ status: 'done' }));
    expect(b.button.style.display).toBe('none');
    b.update(gridState());
    expect(b.button.style.display).toBe('');
    b.button.click();
    expect(asked).toBe(1);
    expect([b.button.disabled, b.button.textContent]).toEqual([true, 'Stopping…']);
    b.update(gridState());
    expect(b.button.disabled).toBe(true); // still stopping while the run goes on
    b.update(gridState({ status: 'interrupted' }));
    expect([b.button.style.display, b.button.disabled, b.button.textContent]).toEqual(['none', false, 'Stop']);
  });
});

/** Each real view, with a state it draws. */
const VIEWS: [string, new (el: HTMLElement, cb?: GridCallbacks) => View, () => GridState, string][] = [
  ['GridView', GridView, () => gridState(), 'pipatch-grid'],
  ['CircuitView', CircuitView, () => circuitState(), 'pipatch-grid pipatch-circuit'],
  ['FeatureView', FeatureView, () => featureState(), 'pipatch-grid pipatch-features'],
];

describe.each(VIEWS)('%s on the base', (_name, Kind, state, cls) => {
  it('observes its root, draws once per update and once per frame after a resize, and ends cleanly', async () => {
    const render = vi.spyOn(Kind.prototype as unknown as { render: () => void }, 'render');
    const el = host();
    const v = new Kind(el, {});
    expect(v.root.className).toBe(cls);
    expect(RecordingObserver.made.map((o) => o.observed)).toEqual([[v.root]]);
    v.update(state());
    expect(render).toHaveBeenCalledTimes(1);
    const title = v.root.querySelector('.pipatch-title')!.textContent;
    expect(title).toBe(state().title);
    // The root grows 600 px wider: the view draws again, once, on the next frame.
    Object.defineProperty(v.root, 'clientWidth', { configurable: true, value: 1600 });
    RecordingObserver.made[0].fire();
    RecordingObserver.made[0].fire();
    await frame();
    expect(render).toHaveBeenCalledTimes(2);
    v.destroy();
    expect(RecordingObserver.made[0].disconnected).toBe(true);
    expect(el.children).toHaveLength(0);
  });
});
