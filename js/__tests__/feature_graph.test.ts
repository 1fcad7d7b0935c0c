import { describe, expect, it } from 'vitest';
import { normalizeState } from '../data';
import { edgeInfo, FeatureView, filterGraph, isFeatureGraph, layoutFeatures, nodeInfo, withGroup } from '../features';
import { GridView } from '../grid';
import { viewFor } from '../views';
import { featureState, HOSTILE } from './helpers';

describe('feature circuit graph', () => {
  it('is told apart from other states and drawn by its own view', () => {
    const s = featureState();
    expect(isFeatureGraph(s)).toBe(true);
    expect(isFeatureGraph(normalizeState({ title: 'x' }))).toBe(false);
    const el = document.createElement('div');
    const v = viewFor(null, s, el, {});
    expect(v).toBeInstanceOf(FeatureView);
    expect(viewFor(v, normalizeState({ title: 'grid' }), el, {})).toBeInstanceOf(GridView);
  });

  it('filters nodes by threshold and top n, and keeps only edges between kept nodes', () => {
    const g = featureState().feature_graph;
    const all = filterGraph(g, { threshold: 0, top: 100 });
    expect(all.nodes).toEqual([0, 1, 2, 3, 4]);
    expect(all.edges.length).toBe(3);
    const big = filterGraph(g, { threshold: 0.15, top: 100 });
    expect(big.nodes).toEqual([0, 1, 2]); // the metric always, then |score| ≥ 0.15
    expect(big.edges).toEqual([]);
    const two = filterGraph(g, { threshold: 0, top: 2 });
    expect(two.nodes).toEqual([0, 1, 2]);
    const three = filterGraph(g, { threshold: 0, top: 3 });
    expect(three.edges.map((e) => [e.up, e.down])).toEqual([[1, 3], [2, 3]]);
  });

  it('lays nodes out by SAE (rows, the first at the bottom) and position (columns), sized by |score|', () => {
    const g = featureState().feature_graph;
    const kept = [0, 1, 2, 3, 4];
    const L = layoutFeatures(g, kept, 900);
    const p = (i: number) => L.at.get(i)!;
    expect(p(1).y).toBeGreaterThan(p(3).y); // L0 below L1
    expect(p(3).y).toBeGreaterThan(p(0).y); // the metric on top
    expect(p(4).x).toBeLessThan(p(1).x); // position 0 left of 1
    expect(p(1).x).toBeLessThan(p(3).x);
    expect(p(2).y).toBe(p(1).y); // one place: side by side
    expect(p(2).x).toBeGreaterThan(p(1).x);
    expect(p(1).r).toBeGreaterThan(p(3).r);
    expect(p(3).r).toBeGreaterThan(p(4).r);
    expect(p(1).r).toBeLessThanOrEqual(12);
    expect(p(4).r).toBeGreaterThanOrEqual(3);
    expect(L.at.has(5)).toBe(false);
  });

  it('says what a node is, its estimate and exact value', () => {
    const [metric, latent, error] = featureState().feature_graph.nodes!;
    const lines = nodeInfo(latent, 'logit_diff');
    expect(lines[1]).toBe('latent 7 at position 1');
    expect(lines).toContain('estimate: 0.3000 (change of logit_diff)');
    expect(lines).toContain('exact: 0.2500');
    expect(nodeInfo(error, 'm')).toContain('exact: not checked');
    expect(nodeInfo(error, 'm')[1]).toMatch(/^error node/);
    expect(nodeInfo(metric, 'm')[1]).toBe('the metric (m)');
  });

  it('says what an edge joins, its estimate and, where checked, its exact value, on hover', () => {
    const g = featureState().feature_graph;
    const [checked, unchecked, old] = g.edges!;
    expect(edgeInfo(checked, g.nodes!, 'logit_diff')).toEqual(['L0 #7 @1 → L1 #3 @2', 'estimate: 0.0500 (change of logit_diff)', 'exact: 0.0400']);
    expect(edgeInfo(unchecked, g.nodes!, 'm')[2]).toBe('exact: not checked');
    expect(edgeInfo(old, g.nodes!, 'm')[2]).toBe('exact: not checked'); // a saved copy from before edges carried it
    const el = document.createElement('div');
    document.body.append(el);
    const v = new FeatureView(el, {});
    v.update(featureState());
    const tip = el.querySelector('.pipatch-tooltip') as HTMLElement;
    const hover = (selector: string) => el.querySelector(selector)!.dispatchEvent(new MouseEvent('mousemove', { bubbles: true, clientX: 5, clientY: 5 }));
    hover('.pipatch-fedge-hit[data-edge="0"]');
    expect(tip.style.display).not.toBe('none');
    expect([...tip.querySelectorAll('.pipatch-tip-line')].map((l) => l.textContent)).toEqual(edgeInfo(checked, g.nodes!, 'logit_diff'));
    hover('.pipatch-fedge[data-edge="1"]');
    expect(tip.textContent).toContain('L0 error @1 → L1 #3 @2');
    expect(tip.textContent).toContain('exact: not checked');
    hover('.pipatch-fnode[data-name="L0 #7 @1"]'); // a node over an edge: the node's lines
    expect(tip.textContent).toContain('latent 7 at position 1');
    el.querySelector('svg.pipatch-feature-graph')!.dispatchEvent(new MouseEvent('mouseleave'));
    expect(tip.style.display).toBe('none');
    expect(JSON.parse(v.jsonText()).edges.map((e: { exact: number | null }) => e.exact)).toEqual([0.04, null, null]);
    v.destroy();
    el.remove();
  });

  it('draws every label as text, never HTML', () => {
    const el = document.createElement('div');
    document.body.append(el);
    const v = new FeatureView(el, {});
    v.update(featureState({ groups: [{ name: HOSTILE, nodes: ['L0 #7 @1', 'L1 #3 @2'] }] }));
    expect(el.querySelector('img')).toBeNull();
    expect(el.querySelectorAll('.pipatch-fnode').length).toBe(5);
    expect(el.querySelectorAll('.pipatch-fedge').length).toBe(3);
    expect(el.querySelector('.pipatch-supernode text')?.textContent).toContain('<img');
    const node = el.querySelector('.pipatch-fnode[data-name="L0 #7 @1"]')!;
    node.dispatchEvent(new MouseEvent('mousemove', { bubbles: true, clientX: 5, clientY: 5 }));
    const tip = el.querySelector('.pipatch-tooltip')!;
    expect(tip.querySelector('img')).toBeNull();
    expect(tip.textContent).toContain('<b>Eiffel</b>');
    expect(v.svgText()).not.toContain('<img');
    expect(JSON.parse(v.jsonText()).supernodes[0].name).toBe(HOSTILE);
    v.destroy();
    el.remove();
  });

  it('filters on the threshold control, asks for an ablation on a click and groups selected nodes', () => {
    const el = document.createElement('div');
    document.body.append(el);
    const asked: string[] = [];
    const grouped: [string, string[]][] = [];
    const v = new FeatureView(el, { live: true, onAblate: (n) => asked.push(n), onGroup: (name, nodes) => grouped.push([name, nodes]) });
    v.update(featureState());
    const threshold = el.querySelector('input.pipatch-threshold') as HTMLInputElement;
    threshold.value = '0.15';
    threshold.dispatchEvent(new Event('input'));
    expect(el.querySelectorAll('.pipatch-fnode').length).toBe(3);
    expect(el.querySelectorAll('.pipatch-fedge').length).toBe(0);
    threshold.value = '0';
    threshold.dispatchEvent(new Event('input'));
    const click = (name: string, shiftKey = false) =>
      el.querySelector(`.pipatch-fnode[data-name="${name}"]`)!.dispatchEvent(new MouseEvent('click', { bubbles: true, shiftKey }));
    click('L1 #3 @2');
    expect(asked).toEqual(['L1 #3 @2']);
    expect(el.querySelector('.pipatch-detail')?.textContent).toContain('exact ablation running');
    click('L0 #7 @1', true);
    (el.querySelector('input.pipatch-group-name') as HTMLInputElement).value = 'towers';
    (el.querySelector('button.pipatch-group') as HTMLButtonElement).click();
    expect(grouped).toEqual([['towers', ['L1 #3 @2', 'L0 #7 @1']]]);
    expect(el.querySelector('.pipatch-supernode')?.getAttribute('data-group')).toBe('towers');
    expect(asked).toEqual(['L1 #3 @2']); // shift-click selects, asks nothing
    v.destroy();
    el.remove();
  });

  it('sets, replaces and removes groups by name', () => {
    let g = withGroup([], 'a', ['x']);
    g = withGroup(g, 'b', ['y']);
    g = withGroup(g, 'a', ['z']);
    expect(g).toEqual([{ name: 'b', nodes: ['y'] }, { name: 'a', nodes: ['z'] }]);
    expect(withGroup(g, 'b', [])).toEqual([{ name: 'a', nodes: ['z'] }]);
  });
});
