/*
 * crust-escape: tries the known ways out of a container's root and prints
 * what each reached, in a form that is the same for every runtime that
 * confines the container (so a test compares runc's report with crust's).
 *
 *   crust-escape NEEDLE
 *
 * Each attempt runs in a child of its own (a chroot cannot be undone):
 *   chroot     mkdir a directory, chroot into it, chdir("..") 64 times,
 *              chroot(".") -- the classic break-out of a chroot jail
 *   proc-root  chroot into /proc/<pid>/root of every visible process
 *   proc-cwd   chdir to /proc/<pid>/cwd of every visible process, then ".."
 *              64 times and chroot(".")
 *   fd         fchdir to every inherited directory descriptor, then as above
 * and after each reports whether "/" is the container's own root (same
 * entries as before), whether a file named NEEDLE is reachable below it
 * (a bounded walk that skips /proc, /sys and /dev), and whether the
 * guest's kernel.core_pattern can be opened for writing. Last, the
 * process's own capabilities and seccomp mode, which no attempt may change.
 * Built static (the test image has no libc).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *needle;
static char found[4096];
static long walked;

/* The sorted names in "/", one string. */
static void listing(char *out, size_t len)
{
	struct dirent **names;
	int n = scandir("/", &names, NULL, alphasort);
	out[0] = 0;
	if (n < 0) {
		snprintf(out, len, "unreadable(%s)", strerror(errno));
		return;
	}
	for (int i = 0; i < n; i++) {
		if (strcmp(names[i]->d_name, ".") && strcmp(names[i]->d_name, "..") &&
		    strncmp(names[i]->d_name, "crust-escape-", 13)) {
			strncat(out, names[i]->d_name, len - strlen(out) - 2);
			strncat(out, " ", len - strlen(out) - 1);
		}
		free(names[i]);
	}
	free(names);
}

static int visit(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	if (++walked > 200000)
		return 1;
	if (ftw->level == 1 && (!strcmp(path, "/proc") || !strcmp(path, "/sys") ||
				!strcmp(path, "/dev")))
		return FTW_SKIP_SUBTREE;
	if (ftw->level > 16)
		return FTW_SKIP_SUBTREE;
	if (!strcmp(path + ftw->base, needle)) {
		snprintf(found, sizeof found, "%s", path);
		return 1;
	}
	return 0;
}

/* What "/" is now, against the container's own root. */
static void report(const char *how, const char *before)
{
	char after[8192];
	listing(after, sizeof after);
	found[0] = 0;
	walked = 0;
	nftw("/", visit, 64, FTW_PHYS | FTW_ACTIONRETVAL);
	int fd = open("/proc/sys/kernel/core_pattern", O_WRONLY);
	const char *core = fd >= 0 ? "writable" : strerror(errno);
	if (fd >= 0)
		close(fd);
	if (strcmp(after, before))
		printf("%s: ESCAPED to a root of [%s]\n", how, after);
	else
		printf("%s: own root\n", how);
	printf("%s: needle %s%s\n", how, found[0] ? "FOUND at " : "not found", found);
	printf("%s: core_pattern %s\n", how, core);
}

static void dotdot_out(void)
{
	for (int i = 0; i < 64; i++)
		if (chdir(".."))
			break;
	if (chroot(".") == 0 && chdir("/") == 0)
		return;
}

/* Runs one attempt in a child; prints nothing when the attempt does not
 * apply (no such process, no such descriptor). */
static void attempt(const char *how, const char *before, int kind, long arg)
{
	fflush(stdout);
	pid_t pid = fork();
	if (pid < 0) {
		printf("%s: fork: %s\n", how, strerror(errno));
		return;
	}
	if (pid == 0) {
		char path[64];
		switch (kind) {
		case 0: {
			char dir[] = "/crust-escape-XXXXXX";
			if (!mkdtemp(dir)) {
				/* A read-only rootfs: the jail goes below /tmp. */
				snprintf(dir, sizeof dir, "/tmp/cesc-XXXXXX");
				if (!mkdtemp(dir)) {
					printf("%s: mkdtemp: %s\n", how, strerror(errno));
					_exit(0);
				}
			}
			if (chroot(dir)) {
				printf("%s: chroot: %s\n", how, strerror(errno));
				_exit(0);
			}
			dotdot_out();
			break;
		}
		case 1:
			snprintf(path, sizeof path, "/proc/%ld/root", arg);
			if (chroot(path) || chdir("/"))
				_exit(0);
			break;
		case 2:
			snprintf(path, sizeof path, "/proc/%ld/cwd", arg);
			if (chdir(path))
				_exit(0);
			dotdot_out();
			break;
		case 3:
			if (fchdir((int)arg))
				_exit(0);
			dotdot_out();
			break;
		}
		report(how, before);
		fflush(stdout);
		_exit(0);
	}
	waitpid(pid, NULL, 0);
}

static void status_line(const char *key)
{
	char line[256];
	FILE *f = fopen("/proc/self/status", "r");
	if (!f)
		return;
	while (fgets(line, sizeof line, f))
		if (!strncmp(line, key, strlen(key)))
			fputs(line, stdout);
	fclose(f);
}

int main(int argc, char **argv)
{
	char before[8192], how[64];
	if (argc != 2) {
		fprintf(stderr, "usage: crust-escape NEEDLE\n");
		return 2;
	}
	needle = argv[1];
	setvbuf(stdout, NULL, _IOLBF, 0);
	listing(before, sizeof before);
	printf("root: [%s]\n", before);
	attempt("chroot", before, 0, 0);

	DIR *proc = opendir("/proc");
	struct dirent *e;
	long self = getpid();
	while (proc && (e = readdir(proc))) {
		char *end;
		long pid = strtol(e->d_name, &end, 10);
		if (*end || pid <= 0 || pid == self)
			continue;
		snprintf(how, sizeof how, "proc-root");
		attempt(how, before, 1, pid);
		snprintf(how, sizeof how, "proc-cwd");
		attempt(how, before, 2, pid);
	}
	if (proc)
		closedir(proc);

	for (int fd = 3; fd < 1024; fd++) {
		struct stat st;
		if (fstat(fd, &st) || !S_ISDIR(st.st_mode))
			continue;
		attempt("fd", before, 3, fd);
	}
	status_line("CapEff:");
	status_line("Seccomp:");
	status_line("NoNewPrivs:");
	return 0;
}
