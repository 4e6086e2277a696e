// guarduq review: the keyboard, as progressive enhancement (every action is also a link or a
// button). r/1 right, w/2 wrong, u/3 unsure, j/n next, k/p previous, / the note box, Escape
// leaves a box. Keys are ignored while typing in a field or with a modifier held.
(function () {
  "use strict";
  var labels = { r: "right", "1": "right", w: "wrong", "2": "wrong", u: "unsure", "3": "unsure" };
  var sent = false;

  function typing(el) {
    if (!el) return false;
    var tag = el.tagName;
    return tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT" || el.isContentEditable;
  }

  function follow(rel) {
    var a = document.querySelector('a[rel="' + rel + '"]');
    if (a) { window.location.assign(a.href); return true; }
    return false;
  }

  document.addEventListener("keydown", function (e) {
    if (e.key === "Escape" && typing(e.target)) { e.target.blur(); return; }  // back to the keys
    if (e.defaultPrevented || e.ctrlKey || e.metaKey || e.altKey || typing(e.target)) return;
    var key = e.key;
    var form = document.getElementById("label-form");
    if (form && labels[key]) {
      var button = form.querySelector('button[name="label"][value="' + labels[key] + '"]');
      if (button && !sent) {
        sent = true;  // one label per page view: a held key must not post twice
        e.preventDefault();
        if (form.requestSubmit) { form.requestSubmit(button); } else { button.click(); }
      }
      return;
    }
    if (key === "j" || key === "n") {
      var start = document.getElementById("start");  // the queue: open its first item
      if (start) { e.preventDefault(); window.location.assign(start.href); return; }
      if (follow("next")) e.preventDefault();
    } else if (key === "k" || key === "p") {
      e.preventDefault();
      if (!follow("prev")) window.history.back();
    } else if (key === "/") {
      var note = document.getElementById("note");
      if (note) { e.preventDefault(); note.focus(); }
    }
  });
})();
