// Row filters for the item tables (works offline, no libraries): each table lists its rows with a
// data-kind; a button's data-show names the kinds it shows ("*" for all).
// With JavaScript the filters show (CSS hides them otherwise, leaving every row visible).
document.documentElement.classList.add("js");
document.querySelectorAll(".filters").forEach(function (bar) {
  var table = document.getElementById(bar.dataset.table);
  var counter = bar.querySelector(".shown");
  function apply(button) {
    var kinds = button.dataset.show.split(" ");
    var shown = 0;
    table.querySelectorAll("tbody tr").forEach(function (row) {
      var visible = kinds[0] === "*" || kinds.indexOf(row.dataset.kind) >= 0;
      row.hidden = !visible;
      if (visible) shown++;
    });
    bar.querySelectorAll("button").forEach(function (b) { b.classList.toggle("active", b === button); });
    if (counter) counter.textContent = shown + " shown";
  }
  bar.querySelectorAll("button").forEach(function (b) {
    b.addEventListener("click", function () { apply(b); });
  });
  var first = bar.querySelector("button[data-default]") || bar.querySelector("button");
  if (first) apply(first);
});
