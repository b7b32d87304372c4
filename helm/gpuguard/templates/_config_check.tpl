{{/*
The value `config`, checked as gpuguard's config loader checks it: a value gpuguard
refuses fails `helm install`, `helm template` and `helm lint` here, with gpuguard's own words,
instead of every enforcer exiting at start on every GPU node.

The rules are files/config-rules.json, which scripts/gen_values_schema.py writes from
gpuguard/config/rules.py together with values.schema.json's `config` (edit neither by hand). The schema
has already refused unknown keys, wrong JSON types and strings outside a closed set; this checks
what a schema cannot say in gpuguard's words: bounds, quantities (the API server's grammar, then
parse_quantity's suffixes, then the 1Mi minimum), namespace names and labels, limits.sources, and the
cross-key rules. Every problem is reported at once, as the loader does.
*/}}
{{- define "gpuguard.checkConfig" -}}
{{- $rules := .Files.Get "files/config-rules.json" | fromJson }}
{{- $config := .Values.config | default dict }}
{{- $problems := list }}
{{- $bad := dict }}
{{- range $section, $table := $config }}
{{- range $key, $value := $table }}
{{- $name := printf "config.%s.%s" $section $key }}
{{- $rule := index $rules.fields $section $key }}
{{- $problem := "" }}
{{- if eq $rule.kind "tables" }}
{{- $problems = concat $problems (include "gpuguard.checkNamespaces" (dict "rules" $rules "tables" $value) | fromJsonArray) }}
{{- else if eq $rule.kind "number" }}
{{- $problem = include "gpuguard.checkNumber" (dict "rule" $rule "value" $value) }}
{{- else if eq $rule.kind "quantity" }}
{{- $problem = (include "gpuguard.quantity" (dict "rules" $rules "rule" $rule "value" $value) | fromJson).problem }}
{{- else if or (eq $rule.kind "namespaces") (eq $rule.kind "gpus") }}
{{- $invalid := list }}
{{- range $value }}{{ if not (regexMatch $rule.pattern .) }}{{ $invalid = append $invalid (toJson .) }}{{ end }}{{ end }}
{{- if $invalid }}{{ $problem = print $rule.allowed (replace "{values}" (join ", " $invalid) $rule.not_valid) }}{{ end }}
{{- else if eq $rule.kind "sources" }}
{{- $seen := dict }}
{{- $twice := list }}
{{- range $value }}{{ if hasKey $seen . }}{{ $twice = append $twice . }}{{ end }}{{ $_ := set $seen . true }}{{ end }}
{{- if not $value }}{{ $problem = print $rule.allowed $rule.empty }}
{{- else if $twice }}{{ $problem = print $rule.allowed (replace "{values}" ($twice | uniq | sortAlpha | join ", ") $rule.twice) }}
{{- end }}
{{- else if eq $rule.kind "label" }}
{{- if or (not (regexMatch $rule.pattern $value)) (gt (len (regexFind "^[^/=]*/" $value)) (int $rule.prefix_max)) }}{{ $problem = $rule.allowed }}{{ end }}
{{- else if eq $rule.kind "path" }}
{{- if or (contains "\x00" $value) (and $rule.absolute (not (hasPrefix "/" $value))) }}{{ $problem = $rule.allowed }}{{ end }}
{{- end }}
{{- if $problem }}
{{- $problems = append $problems (printf "%s = %s: %s" $name (toJson $value) $problem) }}
{{- $_ := set $bad (printf "%s.%s" $section $key) true }}
{{- end }}
{{- end }}
{{- end }}
{{- $problems = concat $problems (include "gpuguard.checkConfigInvariants" (dict "rules" $rules "config" $config "bad" $bad) | fromJsonArray) }}
{{- if $problems }}
{{- fail (printf "gpuguard would refuse this config and every enforcer would exit at start:\n  - %s" (join "\n  - " $problems)) }}
{{- end }}
{{- end }}

{{/* A number within its bounds: "" or the rule's `allowed`. */}}
{{- define "gpuguard.checkNumber" -}}
{{- $rule := .rule }}
{{- $value := float64 .value }}
{{- $low := or (lt $value $rule.minimum) (and (not $rule.inclusive) (eq $value $rule.minimum)) }}
{{- $high := and (kindIs "float64" $rule.maximum) (gt $value (float64 $rule.maximum)) }}
{{- if or $low $high }}{{ $rule.allowed }}{{ end }}
{{- end }}

{{/*
A quantity (a limit, or a size in bytes) as gpuguard.kubemodel.quantity and the config loader
read it: JSON {"problem": "" or gpuguard's message, "bytes": float or null, "percent": float or
null}. Floats are exact for any quantity of up to 15 significant digits; a longer one within an
ulp of a bound may be judged differently (nothing real is written that way).
*/}}
{{- define "gpuguard.quantity" -}}
{{- $q := .rules.quantity }}
{{- $rule := .rule }}
{{- $text := .value }}
{{- $allowed := ternary (print $q.allowed $q.allowed_percent) $q.allowed $rule.percent }}
{{- $out := dict "problem" "" "bytes" nil "percent" nil }}
{{- if and $rule.empty (eq $text "") }}
{{- else if gt (len $text) (int $q.max_chars) }}
{{- $_ := set $out "problem" (printf "%s: %s" $q.causes.too_long $allowed) }}
{{- else if hasSuffix "%" $text }}
{{- if not $rule.percent }}
{{- $_ := set $out "problem" $q.percent_not_allowed }}
{{- else if not (regexMatch $q.percent $text) }}
{{- $_ := set $out "problem" $q.percent_syntax }}
{{- else }}
{{- $number := trimSuffix "%" $text }}
{{- $digits := trimPrefix "+" (trimPrefix "-" $number) }}
{{- $whole := regexReplaceAll "^0+" (regexReplaceAll "[.].*$" $digits "") "" }}
{{- $fraction := regexReplaceAll "^[^.]*" $digits "" }}
{{- $zero := not (regexMatch "[1-9]" $digits) }}
{{- $above := or (gt (len $whole) 3) (and (eq (len $whole) 3) (gt $whole "100")) (and (eq $whole "100") (regexMatch "[1-9]" $fraction)) }}
{{- if or $zero (hasPrefix "-" $number) $above }}
{{- $_ := set $out "problem" $q.percent_range }}
{{- else if lt (float64 $number) $.rules.percent_below_minimum.smallest_percent }}
{{- $_ := set $out "problem" (replace "{value}" $text $.rules.percent_below_minimum.message) }}
{{- else }}
{{- $_ := set $out "percent" (float64 $number) }}
{{- end }}
{{- end }}
{{- else if not (regexMatch $q.api $text) }}
{{- $cause := "syntax" }}
{{- $hint := "" }}
{{- if eq $text "" }}{{ $cause = "empty" }}
{{- else if regexMatch $q.whitespace $text }}{{ $cause = "whitespace" }}
{{- else if regexMatch "^-[0-9]" $text }}{{ $cause = "negative" }}
{{- end }}
{{- if regexMatch $q.byte_unit $text }}
{{- $cause = "unit" }}
{{- $prefix := replace "K" "k" (upper (regexReplaceAll $q.byte_unit $text "${2}")) }}
{{- $hint = replace "{prefix}" $prefix (replace "{number}" (regexReplaceAll $q.byte_unit $text "${1}") $q.unit_hint) }}
{{- end }}
{{- $_ := set $out "problem" (printf "%s%s: %s" (get $q.causes $cause) $hint $allowed) }}
{{- else if not (regexMatch $q.form $text) }}
{{- $cause := ternary "unit" "syntax" (regexMatch $q.unit_letter $text) }}
{{- $_ := set $out "problem" (printf "%s: %s" (get $q.causes $cause) $allowed) }}
{{- else }}
{{- $mantissa := regexReplaceAll $q.form $text "${1}" }}
{{- $suffix := regexReplaceAll $q.form $text "${3}" }}
{{- $written := ternary (regexReplaceAll "^[eE][+]?" $suffix "") "0" (regexMatch "^[eE]" $suffix) }}
{{- $magnitude := regexReplaceAll "^-?0*" $written "" | default "0" }}
{{- $inRange := false }}
{{- if or (lt (len $magnitude) 19) (and (eq (len $magnitude) 19) (lt $magnitude "9")) }}
{{- $exponent := int64 (print (ternary "-" "" (hasPrefix "-" $written)) $magnitude) }}
{{- $internal := sub $exponent (len (regexReplaceAll "^[^.]*[.]?" $mantissa "")) }}
{{- $digits := len (regexReplaceAll "^0*" (replace "." "" $mantissa) "") }}
{{- $adjusted := add $internal (max $digits 1) -1 }}
{{- $inRange = and (le $adjusted (int64 $q.adjusted_max)) (ge $internal (int64 $q.exponent_min)) }}
{{- end }}
{{- if not $inRange }}
{{- $cause := ternary "unit" "syntax" (regexMatch $q.unit_letter $text) }}
{{- $_ := set $out "problem" (printf "%s: %s" (get $q.causes $cause) $allowed) }}
{{- else if not (regexMatch "[1-9]" $mantissa) }}
{{- if $rule.zero }}{{ $_ := set $out "bytes" 0.0 }}{{ else }}{{ $_ := set $out "problem" (printf "%s: %s" $q.causes.zero $allowed) }}{{ end }}
{{- else if hasPrefix "-" $text }}
{{- $_ := set $out "problem" (printf "%s: %s" $q.causes.negative $allowed) }}
{{- else }}
{{- $exponent := "0" }}
{{- $factor := 1.0 }}
{{- if hasKey $q.decimal_exponents $suffix }}{{ $exponent = toString (get $q.decimal_exponents $suffix) }}
{{- else if hasKey $q.binary_factors $suffix }}{{ $factor = get $q.binary_factors $suffix }}
{{- else if $suffix }}{{ $exponent = substr 1 (len $suffix) $suffix }}
{{- end }}
{{- /* Out of float range parses as 0 here: above it saturates as gpuguard does, below it
       a positive amount is at least 1 byte (fractional bytes round up). */}}
{{- $amount := float64 (printf "%se%s" $mantissa $exponent) }}
{{- if eq $amount 0.0 }}{{ $amount = ternary 1.0 $q.max_bytes (hasPrefix "-" $exponent) }}{{ end }}
{{- $bytes := ceil (mulf $amount $factor) }}
{{- if gt $bytes $q.max_bytes }}{{ $bytes = $q.max_bytes }}{{ end }}
{{- if lt $bytes (float64 $rule.min_bytes) }}
{{- $hint := ternary (replace "{text}" $text $q.bare_number_hint) "" (regexMatch "^[0-9]+$" $text) }}
{{- $_ := set $out "problem" (print (replace "{bytes}" (printf "%.0f" $bytes) $q.too_small) $hint) }}
{{- else }}
{{- $_ := set $out "bytes" $bytes }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/*
limits.namespaces: each name a namespace name, each table's limits valid, its default not above
its max (both quantities or both percentages; a percentage and a quantity are not compared). A
JSON list of problems.
*/}}
{{- define "gpuguard.checkNamespaces" -}}
{{- $rules := .rules }}
{{- $problems := list }}
{{- range $namespace, $table := .tables }}
{{- $prefix := printf "config.limits.namespaces.%s" $namespace }}
{{- if not (regexMatch $rules.namespace_name.pattern $namespace) }}
{{- $problems = append $problems (printf "%s: %s" $prefix (replace "{name}" (printf "'%s'" $namespace) $rules.namespace_name.message)) }}
{{- else }}
{{- $parsed := dict }}
{{- range $key := list "default" "max" }}
{{- if hasKey $table $key }}
{{- $value := get $table $key }}
{{- $result := include "gpuguard.quantity" (dict "rules" $rules "rule" (get $rules.namespace $key) "value" $value) | fromJson }}
{{- if $result.problem }}
{{- $problems = append $problems (printf "%s.%s = %s: %s" $prefix $key (toJson $value) $result.problem) }}
{{- else }}
{{- $_ := set $parsed $key $result }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $parsed.default $parsed.max }}
{{- $above := false }}
{{- range $unit := list "bytes" "percent" }}
{{- $default := get $parsed.default $unit }}
{{- $max := get $parsed.max $unit }}
{{- if and (kindIs "float64" $default) (kindIs "float64" $max) }}{{ $above = or $above (gt $default $max) }}{{ end }}
{{- end }}
{{- if $above }}
{{- $problems = append $problems (replace "{table}" $prefix $rules.default_above_max) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $problems }}
{{- end }}

{{/*
The loader's cross-key rules over the values or, where unset, gpuguard's defaults; a key that
failed its own check is left out, as the loader does. A JSON list of problems.
*/}}
{{- define "gpuguard.checkConfigInvariants" -}}
{{- $rules := .rules }}
{{- $config := .config }}
{{- $bad := .bad }}
{{- $problems := list }}
{{- $value := dict }}
{{- $source := dict }}
{{- range $section, $fields := $rules.fields }}
{{- range $key, $rule := $fields }}
{{- $dotted := printf "%s.%s" $section $key }}
{{- $table := get $config $section | default dict }}
{{- if hasKey $table $key }}
{{- $_ := set $value $dotted (get $table $key) }}
{{- $_ := set $source $dotted (printf "config.%s" $dotted) }}
{{- else }}
{{- $_ := set $value $dotted $rule.default }}
{{- $_ := set $source $dotted "default" }}
{{- end }}
{{- end }}
{{- end }}
{{- $staleness := "enforcement.staleness_seconds" }}
{{- range $rules.staleness.bounds }}
{{- $other := printf "%s.%s" .section .key }}
{{- if not (or (hasKey $bad $staleness) (hasKey $bad $other)) }}
{{- $bound := mulf .factor (get $value $other) }}
{{- if le (float64 (get $value $staleness)) $bound }}
{{- $message := replace "{what}" .what $rules.staleness.message | replace "{bound}" (printf "%g" $bound) | replace "{source}" (get $source $other) | replace "{why}" .why }}
{{- $problems = append $problems (printf "config.%s = %g: %s" $staleness (float64 (get $value $staleness)) $message) }}
{{- end }}
{{- end }}
{{- end }}
{{- $fast := "enforcement.fast_interval_seconds" }}
{{- $poll := "enforcement.poll_interval_seconds" }}
{{- if not (or (hasKey $bad $fast) (hasKey $bad $poll)) }}
{{- if gt (float64 (get $value $fast)) (float64 (get $value $poll)) }}
{{- $message := replace "{poll}" (printf "%g" (float64 (get $value $poll))) $rules.fast_interval | replace "{source}" (get $source $poll) }}
{{- $problems = append $problems (printf "config.%s = %g: %s" $fast (float64 (get $value $fast)) $message) }}
{{- end }}
{{- end }}
{{- toJson $problems }}
{{- end }}
