"""A self-contained HTML flame graph of live bytes (no network access needed to view it)."""

from __future__ import annotations

import html
import json

from .snapfile import KIND_NAMES, Snapshot


def _tree(snap: Snapshot) -> dict:
    root: dict = {"n": "all", "v": 0.0, "c": {}}
    for rec in snap.records:
        stack = snap.stacks[rec.stack_id]
        node = root
        node["v"] += rec.est_bytes
        path = [f"[{KIND_NAMES.get(rec.kind, '?')}]"]
        path += [f"{f.function} ({f.filename}:{f.line})" for f in reversed(stack.frames)]
        for name in path:
            child = node["c"].get(name)
            if child is None:
                child = node["c"][name] = {"n": name, "v": 0.0, "c": {}}
            child["v"] += rec.est_bytes
            node = child

    def freeze(node: dict) -> dict:
        kids = sorted(node["c"].values(), key=lambda c: -c["v"])
        return {"n": node["n"], "v": round(node["v"]), "c": [freeze(c) for c in kids]}

    return freeze(root)


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>%(title)s</title>
<style>
body{font:12px monospace;margin:8px}
#g div{position:absolute;height:17px;overflow:hidden;white-space:nowrap;box-sizing:border-box;
border:1px solid #fff;cursor:pointer;padding-left:2px}
#g{position:relative}
#info{height:18px;margin:4px 0}
</style></head><body>
<h3>%(title)s</h3>
<div>click a frame to zoom, click the root to reset</div><div id="info"></div><div id="g"></div>
<script>
const data = %(data)s;
const g = document.getElementById("g"), info = document.getElementById("info");
function fmt(b){const u=["B","KiB","MiB","GiB","TiB"];let i=0;while(b>=1024&&i<4){b/=1024;i++}
  return b.toFixed(1)+" "+u[i]}
function color(s){let h=0;for(const ch of s)h=(h*31+ch.charCodeAt(0))|0;
  return "hsl("+(20+Math.abs(h)%%40)+",80%%,"+(55+Math.abs(h>>8)%%20)+"%%)"}
function render(focus){
  g.innerHTML=""; const W=g.clientWidth||window.innerWidth-20; let depth=0;
  function draw(node,x,w,d){
    if(w<1)return; depth=Math.max(depth,d);
    const el=document.createElement("div");
    el.style.left=x+"px";el.style.top=(d*18)+"px";el.style.width=w+"px";
    el.style.background=color(node.n);el.textContent=node.n;
    el.title=node.n+"\\n"+fmt(node.v);
    el.onmouseover=()=>{info.textContent=node.n+"  "+fmt(node.v)+"  ("+
      (100*node.v/Math.max(data.v,1)).toFixed(1)+"%% of all)"};
    el.onclick=()=>render(node===focus?data:node);
    g.appendChild(el);
    let cx=x;for(const c of node.c){const cw=w*c.v/Math.max(node.v,1);draw(c,cx,cw,d+1);cx+=cw}
  }
  draw(focus,0,W,0); g.style.height=((depth+1)*18)+"px";
}
render(data);
</script></body></html>
"""


def flamegraph_html(snap: Snapshot, title: str | None = None) -> str:
    title = title or f"memprof: live memory of pid {snap.pid}"
    data = json.dumps(_tree(snap), separators=(",", ":")).replace("</", "<\\/")
    return _PAGE % {"title": html.escape(title), "data": data}
