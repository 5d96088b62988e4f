{{/* The rbdkit image reference. */}}
{{- define "rbdkit.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The node plugin's socket directory on the host. */}}
{{- define "rbdkit.socketDir" -}}
{{ .Values.node.kubeletDir }}/plugins/{{ .Values.driverName }}
{{- end -}}
